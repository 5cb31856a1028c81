"""Goodput by search over the request rate (DistServe, arXiv:2401.09670, §2 and §4.1).

Goodput is the highest request rate (requests/s) at which at least ``target`` of the
requests meet both the TTFT and the TPOT SLO. Each probe is a real run, so the
search brackets the answer from a first guess instead of from a loose analytic
bound (as the planner's :func:`mm_serve.planner.goodput.max_rate` does with its
cheap simulator): double (or halve) the rate until one probe passes and one fails,
then bisect geometrically until the bracket ``hi / lo`` is within ``1 + rel_tol``.
With a guess within 2x of the answer and ``rel_tol = 0.1`` that is about five runs.

A probe that was a burst (:attr:`~mm_serve.bench.metrics.RunSummary.burst`: every request sent
before the median one finished) does not pass whatever its attainment: at rates that high a probe
of a fixed number of requests no longer measures a rate.

SLO attainment is made (nearly) monotone in the rate by common random numbers:
every probe replays the same requests on the same unit-rate arrival path scaled
by ``1 / rate`` (see :func:`mm_serve.workloads.arrivals.unit_rate_arrivals`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from mm_serve.bench.metrics import RunSummary

Probe = Callable[[float], RunSummary]


@dataclass(frozen=True)
class SweepResult:
    """The goodput found (requests/s; 0 when even the lowest rate failed) and every probe."""

    goodput: float
    target: float  # attainment target, 0..1
    runs: tuple[RunSummary, ...]  # sorted by rate

    def run_at(self, rate: float) -> RunSummary | None:
        """The probe at ``rate`` requests/s, if there was one."""
        return next((r for r in self.runs if r.rate == rate), None)


def find_goodput(probe: Probe, target: float, start_rate: float, rel_tol: float = 0.1,
                 min_rate: float | None = None, max_steps: int = 8) -> SweepResult:
    """Highest rate (requests/s) whose probe attains ``target`` and was no burst, searched from ``start_rate``.

    Args:
        probe: runs the workload at a rate (requests/s) and returns its summary.
        target: attainment goal (0..1), e.g. 0.9.
        start_rate: first rate tried, requests/s (a guess of the goodput).
        rel_tol: stop when the passing and failing rates are within ``1 + rel_tol``.
        min_rate: below this rate (default ``start_rate / 64``) the goodput is reported as 0.
        max_steps: most doublings (or halvings) while looking for a bracket.

    Raises:
        ValueError: a non-positive or non-finite ``start_rate``, or ``rel_tol <= 0``.
    """
    if not (start_rate > 0 and math.isfinite(start_rate)):
        raise ValueError(f"start rate must be a positive finite number of requests/s, got {start_rate}")
    if rel_tol <= 0:
        raise ValueError(f"relative tolerance must be > 0, got {rel_tol}")
    floor = min_rate if min_rate is not None else start_rate / 64
    runs: dict[float, RunSummary] = {}

    def passes(rate: float) -> bool:
        if rate not in runs:
            runs[rate] = probe(rate)
        return runs[rate].attainment >= target and not runs[rate].burst

    lo, hi = _bracket(passes, start_rate, floor, max_steps)
    if lo > 0 and hi is not None:
        while hi / lo > 1 + rel_tol:
            mid = math.sqrt(lo * hi)
            if passes(mid):
                lo = mid
            else:
                hi = mid
    ordered = tuple(runs[r] for r in sorted(runs))
    return SweepResult(goodput=lo, target=target, runs=ordered)


def _bracket(passes: Callable[[float], bool], start: float, floor: float,
             max_steps: int) -> tuple[float, float | None]:
    """``(lo, hi)``: ``lo`` passed (0 if none above ``floor``), ``hi`` failed (None if none found)."""
    if passes(start):
        lo = start
        for _ in range(max_steps):
            if not passes(lo * 2):
                return lo, lo * 2
            lo *= 2
        return lo, None
    hi = start
    for _ in range(max_steps):
        if hi / 2 < floor:
            break
        if passes(hi / 2):
            return hi / 2, hi
        hi /= 2
    return 0.0, hi
