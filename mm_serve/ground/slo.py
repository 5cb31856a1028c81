"""Latency SLOs in seconds (DistServe, Zhong et al. OSDI 2024, section 2: goodput under SLOs).

Inside mm-serve every latency is in seconds; milliseconds exist only at the configuration
surface (``slo.tiers.<tier>.ttft_ms``), converted once by ``TierSLO.slo``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SLO:
    """Latency targets of one tier or workload.

    Attributes:
        ttft_s: time to first token, seconds.
        tpot_s: time per output token after the first, seconds.
        attainment: the fraction of requests that must meet both (the goodput target).

    Raises (constructor):
        ValueError: a target is not > 0, or ``attainment`` is outside (0, 1].
    """

    ttft_s: float
    tpot_s: float
    attainment: float = 0.9

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLOs must be > 0 s, got TTFT {self.ttft_s}, TPOT {self.tpot_s}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"an SLO attainment target is in (0, 1], got {self.attainment}")

    def met(self, ttft_s: float, tpot_s: float) -> bool:
        """Whether a request with this TTFT and TPOT (seconds) meets both targets."""
        return ttft_s <= self.ttft_s and tpot_s <= self.tpot_s
