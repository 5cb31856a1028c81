"""Worker roles."""

from __future__ import annotations

from enum import Enum


class Role(str, Enum):
    """What a worker runs: the prefill stage, the decode stage, or both (colocated).

    A ``str`` enum: it travels on the wire and in metric labels as its value (``"prefill"``).
    """

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"

    @property
    def prefills(self) -> bool:
        """Whether the role runs prefills (prefill or colocated)."""
        return self is not Role.DECODE

    @property
    def decodes(self) -> bool:
        """Whether the role runs decode steps (decode or colocated)."""
        return self is not Role.PREFILL

    @property
    def hands_off(self) -> bool:
        """Whether the role is one end of hand-off rings (prefill or decode, not colocated)."""
        return self is not Role.COLOCATED

    def __str__(self) -> str:
        return self.value
