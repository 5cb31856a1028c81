"""The refusal an admission check raises; the API turns it into OpenAI's error JSON."""

from __future__ import annotations

import math


class Rejection(Exception):
    """A request refused at admission.

    Attributes:
        status: HTTP status (400 over the work limit, 429 queue caps and SLO misses,
            503 image bytes in flight).
        reason: a short label for the metrics and the error ``code`` (``work_limit``,
            ``queued_requests``, ``queued_tokens``, ``image_bytes``, ``ttft_slo``, ``tpot_slo``).
        retry_after_s: whole seconds for the ``Retry-After`` header; None for a 400.
        param: the request field at fault, if any.
    """

    def __init__(self, status: int, reason: str, message: str, retry_after_s: float | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after_s = None if retry_after_s is None else max(1, math.ceil(retry_after_s))
        self.param = param
