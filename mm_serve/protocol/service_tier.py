"""OpenAI's ``service_tier`` request field, mapped onto our SLO tiers.

====================  ==============================================
``priority``          interactive
``default``           standard
``flex``              batch
``auto`` or absent    the configured default tier (``slo.default_tier``)
``interactive``, ``standard``, ``batch``   themselves (our names)
====================  ==============================================

A response's ``service_tier`` is OpenAI's name of the tier served (:func:`openai_tier`): ``priority``,
``default`` or ``flex``, the values OpenAI's own response types accept.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from mm_serve.ground.tiers import Tier

OPENAI_TIERS: Final = MappingProxyType({"priority": Tier.INTERACTIVE, "default": Tier.STANDARD, "flex": Tier.BATCH})
OUR_TIERS: Final[Mapping[str, Tier]] = MappingProxyType({tier.label: tier for tier in Tier})
OPENAI_NAMES: Final[Mapping[Tier, str]] = MappingProxyType({tier: name for name, tier in OPENAI_TIERS.items()})
ALLOWED_VALUES: Final[tuple[str, ...]] = ("auto", *OPENAI_TIERS, *OUR_TIERS)
ECHO_CHARS = 64  # an unknown service_tier is quoted in its 400 up to this many characters


def check_service_tier(value: object) -> None:
    """Whether a request's ``service_tier`` value is one the table maps (null counts as absent).

    Raises:
        ValueError: not a string (or null), or an unknown name; the message lists the allowed ones.
    """
    allowed = ", ".join(ALLOWED_VALUES)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"service_tier must be a string or null, got {type(value).__name__}; allowed: {allowed}")
    if value is not None and value not in ALLOWED_VALUES:
        shown = repr(value) if len(value) <= ECHO_CHARS else f"{value[:ECHO_CHARS]!r}... ({len(value)} characters)"
        raise ValueError(f"service_tier {shown} is not supported; allowed: {allowed}")


def tier_of(service_tier: str | None, default: Tier) -> Tier:
    """The tier a request's ``service_tier`` asks for (see the module table).

    Raises:
        ValueError: a value :func:`check_service_tier` refuses.
    """
    check_service_tier(service_tier)
    if service_tier is None or service_tier == "auto":
        return default
    if service_tier in OPENAI_TIERS:
        return OPENAI_TIERS[service_tier]
    return OUR_TIERS[service_tier]


def openai_tier(tier: Tier) -> str:
    """OpenAI's ``service_tier`` name of ``tier``, as a response reports it: ``priority``, ``default``, ``flex``."""
    return OPENAI_NAMES[tier]
