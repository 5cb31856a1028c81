"""Client-side latency metrics of one benchmark run: percentiles, SLO attainment, throughput.

Definitions (DistServe, arXiv:2401.09670, §2; the same as vLLM's ``benchmark_serving``):

* **TTFT**: seconds from sending the request to receiving its first content token.
* **TPOT**: ``(e2e - TTFT) / (output_tokens - 1)`` seconds; 0 for a one-token answer.
* **ITL**: seconds between consecutive content chunks of one stream (pooled over requests).
* **e2e**: seconds from sending the request to receiving its last byte.
* **SLO attainment**: the fraction of *all* requests of the run that finished without
  error and met both the TTFT and the TPOT SLO; failed, cancelled and unsent requests
  count as misses.
* **TTFT per turn** and the **prompt-cache hit rate**: :mod:`mm_serve.bench.cache_stats`.
* **A burst**: a run whose requests were all sent in less time than their median e2e latency
  (:attr:`RunSummary.burst`). It says how the server absorbs that many requests at once, not
  whether it sustains the rate: a server that finishes 20 requests sent within a millisecond
  inside the SLOs "passes" 45,000 requests/s. The goodput search does not credit such a run.

Percentiles interpolate linearly between order statistics (numpy's default method),
so they are exact, reproducible numbers on known inputs.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from mm_serve.bench.cache_stats import CacheTokens, ttfts_by_turn
from mm_serve.bench.records import RequestRecord
from mm_serve.ground.slo import SLO

PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0, 99.9)


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    """True when ``record`` finished without error within both the TTFT and the TPOT SLO."""
    if not record.ok or record.ttft_s is None:
        return False
    return record.ttft_s <= slo.ttft_s and record.tpot_s <= slo.tpot_s


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` by linear interpolation; NaN if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


@dataclass(frozen=True)
class Distribution:
    """Mean and the :data:`PERCENTILES` of one latency metric, seconds."""

    mean: float
    p50: float
    p90: float
    p99: float
    p999: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        """Summarise ``values`` (seconds); every field is NaN when there are none."""
        mean = _mean(values)
        p50, p90, p99, p999 = (percentile(values, q) for q in PERCENTILES)
        return cls(mean, p50, p90, p99, p999, len(values))


@dataclass(frozen=True)
class RunSummary:
    """Everything reported about one run at one request rate."""

    rate: float  # offered request rate, requests/s
    num_requests: int  # requests planned for the run
    num_ok: int  # requests that finished without error
    attainment: float  # 0..1, both SLOs, over all planned requests
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    duration_s: float  # first send to last response, seconds
    request_throughput: float  # finished requests/s over duration_s
    output_throughput: float  # output tokens/s over duration_s
    mean_prompt_tokens: float  # server-reported prompt tokens (image tokens included); NaN if unreported
    mean_output_tokens: float  # output tokens per finished request
    stopped_early: bool  # the run was cut short once attainment < target was certain
    errors: dict[str, int]  # failed requests by error message (first 120 characters)
    ttft_by_turn: dict[str, Distribution] = field(default_factory=dict)  # "1", "2", ..., "2+"; {} if no turns
    cache: CacheTokens = CacheTokens(0, 0, 0)  # usage.prompt_tokens_details.cached_tokens, summed
    server_counters: dict[str, float] = field(default_factory=dict)  # /metrics cache counters, run delta
    arrival_span_s: float = math.nan  # first send to last send, seconds (NaN: none sent)

    @property
    def burst(self) -> bool:
        """The requests were all sent in less time than their median e2e latency: the run measured how a burst
        of them is absorbed, not a sustained rate (see the module docstring). False without finished requests."""
        return self.arrival_span_s < self.e2e.p50  # False when either is NaN


def attainment(records: Sequence[RequestRecord], slo: SLO) -> float:
    """Fraction (0..1) of ``records`` meeting both SLOs; 0 for an empty run."""
    if not records:
        return 0.0
    return sum(1 for r in records if meets_slo(r, slo)) / len(records)


def summarize(records: Sequence[RequestRecord], rate: float, slo: SLO | None,
              stopped_early: bool = False) -> RunSummary:
    """Summarise one run of ``records`` at ``rate`` requests/s against ``slo`` (NaN attainment if None)."""
    done = [r for r in records if r.ok and r.ttft_s is not None]
    sent = [r for r in records if r.sent_s is not None]
    start = min((r.sent_s for r in sent if r.sent_s is not None), default=0.0)
    end = max((r.end_s for r in sent if r.end_s is not None), default=start)
    last_sent = max((r.sent_s for r in sent if r.sent_s is not None), default=math.nan)
    duration = max(end - start, 1e-9)
    return RunSummary(
        rate=rate,
        num_requests=len(records),
        num_ok=len(done),
        attainment=attainment(records, slo) if slo is not None else math.nan,
        ttft=Distribution.of([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot=Distribution.of([r.tpot_s for r in done]),
        itl=Distribution.of([gap for r in done for gap in r.itls_s]),
        e2e=Distribution.of([r.e2e_s for r in done if r.e2e_s is not None]),
        duration_s=duration if sent else 0.0,
        request_throughput=len(done) / duration if sent else 0.0,
        output_throughput=sum(r.output_tokens for r in done) / duration if sent else 0.0,
        mean_prompt_tokens=_mean([float(r.prompt_tokens) for r in done if r.prompt_tokens is not None]),
        mean_output_tokens=_mean([float(r.output_tokens) for r in done]),
        stopped_early=stopped_early,
        errors=dict(Counter((r.error or "")[:120] for r in records if r.error is not None)),
        ttft_by_turn={turn: Distribution.of(v) for turn, v in ttfts_by_turn(records).items()},
        cache=CacheTokens.of(records),
        arrival_span_s=last_sent - start if sent else math.nan,
    )
