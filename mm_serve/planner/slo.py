"""SLOs and SLO attainment of a simulated run (DistServe §2: goodput under SLOs)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from mm_serve.planner.sim_request import SimRequest

Phase = Literal["both", "prefill", "decode"]


@dataclass(frozen=True)
class SLO:
    """Latency targets, seconds: time to first token and time per output token."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLOs must be > 0 s, got TTFT {self.ttft_s}, TPOT {self.tpot_s}")


@dataclass(frozen=True)
class SimResult:
    """Per-request outcome of one simulation."""

    requests: Sequence[SimRequest]

    def attainment(self, slo: SLO, phase: Phase = "both", skip: int = 0) -> float:
        """Fraction of requests meeting the TTFT SLO ("prefill"), the TPOT SLO
        ("decode"), or both; a request that never finished misses. The first ``skip``
        requests (warm-up) are left out."""
        reqs = self.requests[skip:]
        if not reqs:
            return 0.0
        if phase == "prefill":
            ok = sum(1 for r in reqs if r.ttft <= slo.ttft_s)
        elif phase == "decode":
            ok = sum(1 for r in reqs if r.tpot <= slo.tpot_s)
        else:
            ok = sum(1 for r in reqs if r.ttft <= slo.ttft_s and r.tpot <= slo.tpot_s)
        return ok / len(reqs)

    def mean_ttft(self) -> float:
        """Mean TTFT, seconds."""
        return sum(r.ttft for r in self.requests) / len(self.requests)

    def mean_tpot(self) -> float:
        """Mean TPOT, seconds."""
        return sum(r.tpot for r in self.requests) / len(self.requests)

    def percentile(self, metric: Literal["ttft", "tpot"], q: float) -> float:
        """The ``q``-quantile (0..1, nearest rank) of TTFT or TPOT, seconds."""
        values = sorted(getattr(r, metric) for r in self.requests)
        return values[min(len(values) - 1, max(0, round(q * len(values)) - 1))]
