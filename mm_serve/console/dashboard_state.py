"""What ``GET /internal/dashboard`` answers: the service's state now and over the last minutes, built from
the samples ``/metrics`` renders (:func:`~mm_serve.console.history.read_samples`), the workers' states
``/health`` reports, the time series of :class:`~mm_serve.console.history.MetricsHistory` and the phases
of :class:`~mm_serve.console.recent.RecentRequests`."""

from __future__ import annotations

import time
from typing import Any

from mm_serve.console.history import MetricsHistory, Sample, read_samples
from mm_serve.console.recent import RecentRequests
from mm_serve.ground.tiers import Tier
from mm_serve.pipeline.context import ServerContext

# per worker, the gauges shown beside its state (sample name -> field)
_WORKER_FIELDS = {"mm_serve_requests_running": "running", "mm_serve_requests_waiting": "waiting",
                  "mm_serve_kv_pages_used": "kv_pages_used", "mm_serve_kv_pages_total": "kv_pages_total",
                  "mm_serve_ring_slots_used": "ring_slots_used"}
_FAULTS = {"mm_serve_worker_restarts_total": "restarts", "mm_serve_request_migrations_total": "migrations",
           "mm_serve_requests_failed_by_fault_total": "failed_by_fault"}


def dashboard_state(ctx: ServerContext, history: MetricsHistory, recent: RecentRequests) -> dict[str, Any]:
    """The dashboard's JSON: ``status`` and ``workers`` (name -> state ``ready | warming | restarting | down``,
    its last fault, running and waiting requests, KV pages and ring slots in use), ``faults`` (role ->
    restarts, migrations, requests failed by a fault), ``caches`` (prefix-cache hit rate in prompt tokens
    and encoder-cache hit rate in images, since start; None before any lookup), ``slo`` (tier -> its TTFT
    and TPOT SLOs, seconds), ``series`` (:meth:`MetricsHistory.series`) and ``recent`` (the waterfall,
    newest first)."""
    status, workers, faults = ctx.holder.health()
    samples = read_samples(history.registry)
    rows = {}
    for name, state in sorted(workers.items()):
        row: dict[str, Any] = {"state": state, "fault": faults.get(name)}
        for metric, field in _WORKER_FIELDS.items():
            row[field] = samples.get((metric, (("worker", name),)))
        rows[name] = row
    by_role: dict[str, dict[str, float]] = {}
    for (metric, labels), value in samples.items():
        if metric in _FAULTS:
            by_role.setdefault(dict(labels).get("role", ""), {})[_FAULTS[metric]] = value
    return {
        "time": time.time(), "status": status, "model": ctx.served_model_name, "workers": rows, "faults": by_role,
        "caches": {"prefix_hit_rate": _ratio(samples, "mm_serve_prefix_cache_hit_tokens_total",
                                             ("mm_serve_prefix_cache_queried_tokens_total",)),
                   "encoder_hit_rate": _ratio(samples, "mm_serve_encoder_cache_hits_total",
                                              ("mm_serve_encoder_cache_hits_total",
                                               "mm_serve_encoder_cache_misses_total"))},
        "slo": {tier.label: {"ttft_s": ctx.config.slo.of(tier).ttft_s, "tpot_s": ctx.config.slo.of(tier).tpot_s}
                for tier in Tier},
        "series": history.series(), "recent": recent.rows(),
    }


def _ratio(samples: dict[Sample, float], part: str, whole: tuple[str, ...]) -> float | None:
    """``part / sum(whole)`` summed over every worker's samples; None while the whole is 0."""
    def total(name: str) -> float:
        return sum(v for (n, _), v in samples.items() if n == name)
    denominator = sum(total(name) for name in whole)
    return total(part) / denominator if denominator > 0 else None
