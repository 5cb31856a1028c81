"""SLO tiers: one ordered enum, used from the API down to the schedulers.

A tier's value is its rank: a lower rank is served first by the prefill queue, refused for
latency first and preempted last by decode. The configuration names tiers by their
:attr:`Tier.label` (``slo.tiers.interactive``, ``slo.default_tier: standard``); OpenAI's
``service_tier`` values map onto them in :mod:`mm_serve.admission.service_tier`.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Literal

TierLabel = Literal["interactive", "standard", "batch"]


class Tier(IntEnum):
    """An SLO tier, tightest first (``Tier.INTERACTIVE < Tier.BATCH``); the value is the rank."""

    INTERACTIVE = 0
    STANDARD = 1
    BATCH = 2

    @property
    def label(self) -> TierLabel:
        """The tier's name in the configuration, metrics and responses: ``"interactive"``, ..."""
        return _LABELS[self]

    @classmethod
    def from_label(cls, label: str) -> Tier:
        """The tier named ``label``.

        Raises:
            ValueError: not one of ``interactive``, ``standard``, ``batch``.
        """
        if label not in _LABELS:
            raise ValueError(f"unknown tier {label!r}; tiers are {', '.join(_LABELS)}")
        return cls(_LABELS.index(label))

    @classmethod
    def clamp(cls, rank: int) -> Tier:
        """The tier of a rank read off the wire, clamped into the known ranks."""
        return cls(min(max(rank, 0), len(cls) - 1))


_LABELS: tuple[TierLabel, ...] = ("interactive", "standard", "batch")

NEVER_REFUSED = Tier.BATCH  # refused for no latency reason, only bounded and queued (the dispatch hold)
