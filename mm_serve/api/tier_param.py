"""The ``service_tier`` request field → the SLO tier served (400 for an unknown value)."""

from __future__ import annotations

from mm_serve.admission.tiers import Tier, tier_of
from mm_serve.api.errors import bad_request
from mm_serve.config import SLOConfig


def request_tier(service_tier: str | None, slo: SLOConfig) -> Tier:
    """The tier a request asks for (mapping in :mod:`mm_serve.admission.tiers`).

    Raises:
        APIError: 400 ``invalid_service_tier`` naming the allowed values.
    """
    try:
        return tier_of(service_tier, slo)
    except ValueError as exc:
        raise bad_request(str(exc), "service_tier", "invalid_service_tier") from None
