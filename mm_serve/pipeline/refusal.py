"""An admission refusal as the OpenAI error the client receives."""

from __future__ import annotations

from mm_serve.admission.rejection import Rejection
from mm_serve.protocol.errors import APIError, retry_after


def from_rejection(rejection: Rejection) -> APIError:
    """The OpenAI error of an admission refusal: 400 ``invalid_request_error``, 429
    ``rate_limit_error`` or 503 ``service_unavailable``; ``code`` is the reason and
    ``Retry-After`` the refusal's whole seconds, when it gives one."""
    kind = {400: "invalid_request_error", 429: "rate_limit_error"}.get(rejection.status, "service_unavailable")
    return APIError(rejection.status, rejection.message, kind, rejection.param, rejection.reason,
                    retry_after(rejection.retry_after_s))
