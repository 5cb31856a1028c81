"""The dashboard's time series, read from the Prometheus registry that ``/metrics`` renders (one source of
truth): a snapshot of the counters and histogram buckets it charts, once a second for the last minutes, and
the series the page draws, as differences of those snapshots.

Percentiles come from a histogram's bucket counts as Prometheus' ``histogram_quantile`` estimates them
(linear within the bucket that holds the rank); SLO attainment per tier is ``met / finished`` of the
requests that finished in the last :data:`ATTAINMENT_WINDOW_S` seconds.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry

WINDOW_S = 300  # seconds of history kept (one snapshot a second)
RATE_WINDOW_S = 5  # request rate and latency percentiles over this many seconds
ATTAINMENT_WINDOW_S = 30  # attainment over the requests that finished in this many seconds
QUANTILES = (0.5, 0.9, 0.99)
TTFT = "mm_serve_time_to_first_token_seconds_bucket"
TPOT = "mm_serve_time_per_output_token_seconds_bucket"
REQUESTS = "mm_serve_requests_total"
FINISHED = "mm_serve_tier_finished_total"
MET = "mm_serve_tier_slo_met_total"
REJECTED = "mm_serve_tier_rejected_total"
_KEPT = frozenset({TTFT, TPOT, REQUESTS, FINISHED, MET, REJECTED})

Sample = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted label pairs)
Snapshot = tuple[float, dict[Sample, float]]  # (time.time() seconds, values)


def read_samples(registry: CollectorRegistry, names: Iterable[str] | None = None) -> dict[Sample, float]:
    """Every sample of ``registry`` (those named in ``names`` only, when given), as ``/metrics`` would
    render them now."""
    wanted = None if names is None else frozenset(names)
    out: dict[Sample, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if wanted is None or sample.name in wanted:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile (0-1) of a histogram from its cumulative ``(le, count)`` buckets (sorted by ``le``,
    the last ``+Inf``), as Prometheus' ``histogram_quantile``: linear within the bucket holding rank
    ``q * total``, the highest finite bound for a rank in the ``+Inf`` bucket. None for an empty histogram."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank, low, below = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank and count > below:
            if math.isinf(le):
                return low
            return low + (le - low) * (rank - below) / (count - below)
        low, below = (le if not math.isinf(le) else low), count
    return low


class MetricsHistory:
    """Snapshots of the registry's charted samples (:meth:`sample`, once a second), and the series
    computed from them (:meth:`series`). Thread-safe."""

    def __init__(self, registry: CollectorRegistry, window_s: int = WINDOW_S) -> None:
        self.registry = registry
        self._snapshots: deque[Snapshot] = deque(maxlen=window_s + ATTAINMENT_WINDOW_S)
        self._lock = threading.Lock()

    def sample(self, now: float | None = None) -> None:
        """Take a snapshot now (``now``: its time, ``time.time()`` seconds)."""
        values = read_samples(self.registry, _KEPT)
        with self._lock:
            self._snapshots.append((time.time() if now is None else now, values))

    def series(self) -> list[dict[str, Any]]:
        """One point per snapshot after the first (oldest first): ``t`` (``time.time()`` seconds),
        ``rate`` (finished requests per second), ``ttft`` and ``tpot`` (seconds at :data:`QUANTILES`,
        ``p50``/``p90``/``p99``; None without requests), ``attainment`` (tier label -> met / finished,
        None for a tier with none finished) and ``refusals`` (reason -> calls refused since the last
        snapshot)."""
        with self._lock:
            snapshots = list(self._snapshots)
        points = []
        for i in range(max(1, len(snapshots) - WINDOW_S), len(snapshots)):
            t, now = snapshots[i]
            t_rate, rate_base = snapshots[max(0, i - RATE_WINDOW_S)]
            last = snapshots[i - 1][1]
            attainment_base = snapshots[max(0, i - ATTAINMENT_WINDOW_S)][1]
            points.append({
                "t": t,
                "rate": _delta_sum(now, rate_base, REQUESTS) / max(t - t_rate, 1e-9),
                "ttft": _quantiles(now, rate_base, TTFT),
                "tpot": _quantiles(now, rate_base, TPOT),
                "attainment": _attainment(now, attainment_base),
                "refusals": _by_label(now, last, REJECTED, "reason"),
            })
        return points


def _delta_sum(now: dict[Sample, float], base: dict[Sample, float], name: str) -> float:
    return sum(v - base.get(k, 0.0) for k, v in now.items() if k[0] == name)


def _by_label(now: dict[Sample, float], base: dict[Sample, float], name: str, label: str) -> dict[str, float]:
    """The increase of ``name`` from ``base`` to ``now``, summed by the value of its ``label``."""
    out: dict[str, float] = {}
    for key, value in now.items():
        if key[0] == name:
            labels = dict(key[1])
            out[labels.get(label, "")] = out.get(labels.get(label, ""), 0.0) + value - base.get(key, 0.0)
    return out


def _quantiles(now: dict[Sample, float], base: dict[Sample, float], name: str) -> dict[str, float | None]:
    buckets = sorted((float(dict(key[1])["le"]), value - base.get(key, 0.0))
                     for key, value in now.items() if key[0] == name)
    return {f"p{round(q * 100)}": bucket_quantile(buckets, q) for q in QUANTILES}


def _attainment(now: dict[Sample, float], base: dict[Sample, float]) -> dict[str, float | None]:
    finished, met = _by_label(now, base, FINISHED, "tier"), _by_label(now, base, MET, "tier")
    return {tier: (met.get(tier, 0.0) / count if count > 0 else None) for tier, count in finished.items()}
