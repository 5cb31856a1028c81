"""SLO attainment and latency figures of a simulated run (DistServe §2: goodput under SLOs).

The SLO itself is the ground one (:class:`mm_serve.ground.slo.SLO`, seconds); every
latency here is in seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from mm_serve.ground.slo import SLO
from mm_serve.planner.sim_request import SimRequest

Phase = Literal["both", "prefill", "decode"]


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
