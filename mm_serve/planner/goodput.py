"""Goodput search: the highest request rate whose SLO attainment meets the target.

DistServe (arXiv:2401.09670, §4.1, Algorithm 1 ``simu_prefill`` / ``simu_decode``)
binary-searches the rate with the simulator. Here the search is geometric (rates
span orders of magnitude) and starts from an analytic upper bound on throughput,
so about eight simulations pin the rate to within ``rel_tol``. Attainment is made
(nearly) monotone in the rate by common random numbers: every probe replays the
same requests on the same unit-rate arrival path, time-scaled by ``1 / rate``.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def max_rate(
    attainment_at: Callable[[float], float],
    target: float,
    upper: float,
    rel_tol: float = 0.02,
    span: float = 64.0,
    max_growth: int = 8,
    max_shrink: int = 4,
    ceiling: float = math.inf,
) -> float:
    """Largest rate (requests/s) with ``attainment_at(rate) >= target``; 0 if none.

    Args:
        attainment_at: simulated SLO attainment (0..1) at a rate in requests/s.
        target: attainment goal, e.g. 0.9.
        upper: a rate expected to fail (an analytic throughput bound), probed first (or
            ``ceiling`` where lower). If it passes, the search doubles it (at most ``max_growth``
            times) until one fails.
        rel_tol: stop when the bracket ``hi / lo`` is within ``1 + rel_tol``.
        span: the first search floor is the first probe's rate ``/ span``; while a floor fails, the next is
            ``span`` times lower, ``max_shrink`` floors in all; below the last the answer is 0.
        ceiling: a rate (requests/s) the system cannot exceed whatever the probes say (the
            throughput its profiled step times allow): no probe goes above it, and the answer is
            at most it (a passing ceiling is the answer). Without it, a probe too short to reveal
            overload passes at any rate and the answer is ``upper * 2 ** max_growth``.

    Raises:
        ValueError: ``upper`` or ``ceiling`` is not a positive rate (``upper`` finite).
    """
    if upper <= 0 or not math.isfinite(upper):
        raise ValueError(f"upper bound must be a positive finite rate, got {upper}")
    if not ceiling > 0:
        raise ValueError(f"ceiling must be a positive rate, got {ceiling}")
    hi = min(upper, ceiling)
    if attainment_at(hi) >= target:
        lo = hi
        for _ in range(max_growth):
            if lo >= ceiling:
                return ceiling
            hi = min(lo * 2, ceiling)
            if attainment_at(hi) < target:
                break
            lo = hi
        else:
            return lo
        return _bisect(attainment_at, target, lo, hi, rel_tol, lo_tested=True)
    # the first probe fails: look for a passing floor ``span`` times lower, then lower again (an
    # analytic bound can be far off, e.g. for a tiny model whose hand-off dominates)
    floor = hi / span
    for _ in range(max_shrink):
        if attainment_at(floor) >= target:
            return _bisect(attainment_at, target, floor, hi, rel_tol, lo_tested=True)
        hi, floor = floor, floor / span
    return 0.0


def _bisect(
    attainment_at: Callable[[float], float],
    target: float,
    lo: float,
    hi: float,
    rel_tol: float,
    lo_tested: bool,
) -> float:
    """Geometric bisection of ``[lo, hi]`` where ``hi`` fails; ``lo`` may be untested."""
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        if attainment_at(mid) >= target:
            lo, lo_tested = mid, True
        else:
            hi = mid
    if lo_tested or attainment_at(lo) >= target:
        return lo
    return 0.0
