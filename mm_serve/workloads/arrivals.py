"""Arrival processes: when each request of a workload is sent, seconds from the start.

Seeded like the workloads, so ``mm-serve bench`` and the placement simulator
(``mm-serve plan``) replay the same arrival times. The gamma-renewal process is
drawn at unit rate and scaled by ``1 / rate``, so every rate of a sweep follows one
sample path (common random numbers across rates).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from mm_serve.workloads.spec import RequestSpec, WorkloadError

MAX_BURSTINESS = 100.0  # CV of the gaps; beyond it a gamma draw underflows to all-at-once
MIN_BURSTINESS = 0.001  # below it the gamma shape 1 / CV^2 overflows; 0.001 is already periodic


def check_burstiness(cv: float) -> None:
    """Raises :class:`WorkloadError` unless ``MIN_BURSTINESS <= cv <= MAX_BURSTINESS``."""
    if not MIN_BURSTINESS <= cv <= MAX_BURSTINESS:
        raise WorkloadError(f"burstiness (CV) must be in {MIN_BURSTINESS:g}..{MAX_BURSTINESS:g}, got {cv}")


def unit_rate_arrivals(n: int, seed: int, cv: float = 1.0) -> list[float]:
    """Arrival times (seconds) of ``n`` requests at mean rate 1 request/s.

    Gaps are gamma-distributed with shape ``1 / cv**2`` and mean 1, so ``cv = 1`` is
    a Poisson process and ``cv > 1`` is burstier. Divide by a rate R (requests/s) to
    get the same sample path at rate R (common random numbers across rates).
    """
    check_burstiness(cv)
    rng = random.Random(f"arrivals:{seed}:{cv}")
    shape = 1.0 / (cv * cv)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(1.0) if cv == 1.0 else rng.gammavariate(shape, 1.0 / shape)
        out.append(t)
    return out


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrival times (seconds) at ``rate`` requests/s."""
    return gamma_arrivals(n, rate, 1.0, seed)


def gamma_arrivals(n: int, rate: float, cv: float, seed: int) -> list[float]:
    """Gamma-renewal arrival times (seconds) at ``rate`` requests/s with gap CV ``cv``."""
    if rate <= 0:
        raise WorkloadError(f"rate must be > 0 requests/s, got {rate}")
    return [t / rate for t in unit_rate_arrivals(n, seed, cv)]


def trace_arrivals(specs: Sequence[RequestSpec], rate: float | None = None) -> list[float]:
    """Arrival times from trace timestamps, rescaled to mean ``rate`` requests/s if given."""
    stamps = [s.arrival_s or 0.0 for s in specs]  # grouped by conversation: not sorted
    first, last = min(stamps, default=0.0), max(stamps, default=0.0)
    if rate is None or len(stamps) < 2 or last <= first:
        return stamps
    scale = (len(stamps) - 1) / (rate * (last - first))
    return [(t - first) * scale for t in stamps]
