"""SLO tiers and the mapping of OpenAI's ``service_tier`` values onto them.

Tiers, tightest first: ``interactive`` (rank 0), ``standard`` (1), ``batch`` (2). A
lower rank is served first by the prefill queue and preempted last by decode.

OpenAI ``service_tier`` → tier:

====================  ==============================================
``priority``          interactive
``default``           standard
``flex``              batch
``auto`` or absent    ``slo.default_tier``
``interactive``, ``standard``, ``batch``   themselves (our names)
====================  ==============================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from mm_serve.config import SLOConfig, TierName, TierSLO

TIERS: Final[tuple[TierName, ...]] = ("interactive", "standard", "batch")
OPENAI_TIERS: Final[dict[str, TierName]] = {"priority": "interactive", "default": "standard", "flex": "batch"}
ALLOWED_VALUES: Final[tuple[str, ...]] = ("auto", *OPENAI_TIERS, *TIERS)


def tier_rank(tier: str) -> int:
    """0 for ``interactive``, 1 for ``standard``, 2 for ``batch``.

    Raises:
        ValueError: ``tier`` is not one of :data:`TIERS`.
    """
    try:
        return TIERS.index(tier)  # type: ignore[arg-type]
    except ValueError:
        raise ValueError(f"unknown tier {tier!r}; tiers are {', '.join(TIERS)}") from None


ECHO_CHARS = 64  # an unknown service_tier is quoted in its 400 up to this many characters


def check_service_tier(value: object) -> None:
    """Whether a request's ``service_tier`` value is one this table maps (null counts as absent).

    Raises:
        ValueError: not a string (or null), or an unknown name; the message lists the allowed ones.
    """
    allowed = ", ".join(ALLOWED_VALUES)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"service_tier must be a string or null, got {type(value).__name__}; allowed: {allowed}")
    if value is not None and value not in ALLOWED_VALUES:
        shown = repr(value) if len(value) <= ECHO_CHARS else f"{value[:ECHO_CHARS]!r}... ({len(value)} characters)"
        raise ValueError(f"service_tier {shown} is not supported; allowed: {allowed}")


def resolve_tier(service_tier: str | None, slo: SLOConfig) -> TierName:
    """The tier a request's ``service_tier`` asks for (see the module table).

    Raises:
        ValueError: a value :func:`check_service_tier` refuses.
    """
    check_service_tier(service_tier)
    if service_tier is None or service_tier == "auto":
        return slo.default_tier
    if service_tier in OPENAI_TIERS:
        return OPENAI_TIERS[service_tier]
    return service_tier  # type: ignore[return-value]  # one of TIERS: checked above


def tier_slo(tier: str, slo: SLOConfig) -> TierSLO:
    """The SLO of ``tier``.

    Raises:
        ValueError: ``tier`` is not one of :data:`TIERS`.
    """
    tier_rank(tier)
    slo_of: TierSLO = getattr(slo.tiers, tier)
    return slo_of


@dataclass(frozen=True)
class Tier:
    """The tier a call is served in: its name, rank and SLO."""

    name: TierName
    rank: int
    slo: TierSLO
    # prefill ageing: after this many seconds in a prefill queue it is served as rank 0 (0: never)
    max_wait_s: float = 0.0


def ageing_seconds(tier: str, slo: SLOConfig) -> float:
    """Seconds after which a queued prefill request of ``tier`` is served as the tightest tier
    (rank 0; 0.0 for the tightest tier itself): when what is left of its TTFT SLO is the
    tightest tier's TTFT SLO, the time a request of that tier is promised; at least half its own
    TTFT SLO, so a tier whose SLO is close to the tightest one's keeps some precedence.

    From then on it is served in arrival order with the tightest tier's requests: the ones that
    arrived after it wait for it. A looser request admitted just before a burst of tighter ones
    otherwise waits for the whole burst (and ageing at its full TTFT SLO, as before 2026-12-03,
    served it only once it was already late).

    Raises:
        ValueError: ``tier`` is not one of :data:`TIERS`.
    """
    if tier_rank(tier) == 0:
        return 0.0
    own, tightest = tier_slo(tier, slo).ttft_ms / 1000.0, tier_slo(TIERS[0], slo).ttft_ms / 1000.0
    return max(own - tightest, own / 2)


def tier_of(service_tier: str | None, slo: SLOConfig) -> Tier:
    """The :class:`Tier` of a request's ``service_tier`` value (see the module table).

    Raises:
        ValueError: an unknown value; the message lists the allowed ones.
    """
    name = resolve_tier(service_tier, slo)
    return Tier(name, tier_rank(name), tier_slo(name, slo), ageing_seconds(name, slo))
