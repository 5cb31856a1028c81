"""Prometheus metrics of the service (prometheus-client), all named ``mm_serve_*``.

The API process aggregates: request-level histograms are observed when a
request finishes (its lifetime events come back from the workers in the token
updates), and per-worker gauges are read at scrape time from the workers' latest
:class:`~mm_serve.runtime.messages.WorkerStats`. Each server owns its own
``CollectorRegistry`` (no process-global state), so two services in one process
never mix their numbers.

TTFT and TPOT follow DistServe §2: TTFT from the API receiving the request to the
first output token reaching it; TPOT = (finish − first token) / (output tokens − 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mm_serve.engine.request_state import RequestState
from mm_serve.runtime.lifetime import LifetimeEvent

# Seconds, from 1 ms (GPU decode steps) to a minute (long CPU prefills), roughly x2.5 per bucket.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)

# (histogram, begin event, end event, stage label or None) from the workers' lifetime events.
_EVENT_SPANS = (
    ("queue", LifetimeEvent.PREFILL_QUEUED, LifetimeEvent.ENCODE_BEGIN, "prefill"),
    ("encode", LifetimeEvent.ENCODE_BEGIN, LifetimeEvent.ENCODE_END, None),
    ("prefill", LifetimeEvent.ENCODE_END, LifetimeEvent.PREFILL_END, None),
    ("handoff", LifetimeEvent.HANDOFF_BEGIN, LifetimeEvent.HANDOFF_END, None),
    ("queue", LifetimeEvent.HANDOFF_END, LifetimeEvent.FIRST_DECODE, "decode"),
)


class ServiceMetrics:
    """Request histograms and counters, observed by :meth:`observe_finished`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

        def hist(name: str, doc: str, labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(f"mm_serve_{name}", doc, labels, registry=registry, buckets=LATENCY_BUCKETS)

        self.ttft = hist("time_to_first_token_seconds", "Request received to first output token (TTFT).")
        self.tpot = hist("time_per_output_token_seconds", "Mean time per output token after the first (TPOT), of "
                         "requests that finished (stop or length).")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens (ITL).")
        self.e2e = hist("e2e_request_latency_seconds", "Request received to last output token, of requests that "
                        "finished (stop or length).")
        self.queue = hist("queue_time_seconds", "Time waiting in a stage's queue.", ("stage",))
        self.encode = hist("encode_seconds", "Vision encoder + projector time of a request's prefill batch (requests "
                           "with images or videos).")
        self.prefill = hist("prefill_seconds", "LLM prefill time of a request's prefill batch.")
        self.handoff = hist("kv_handoff_seconds", "KV hand-off: publish start to decode's copy done.")
        self.requests = Counter("mm_serve_requests", "Finished requests: engine requests (a call's n choices count n) by finish "
                                "reason and their answer's status, and calls refused before any ran.",
                                ("finish_reason", "status_code"),
                                registry=registry)
        self.prompt_tokens = Counter("mm_serve_prompt_tokens", "Prompt tokens, image tokens included (once per "
                                     "prompt, whatever its call's n).", registry=registry)
        self.generation_tokens = Counter("mm_serve_generation_tokens", "Generated tokens.", registry=registry)
        self.images = Counter("mm_serve_image_inputs", "Images and videos received (once per prompt, whatever its "
                              "call's n).", registry=registry)

    def observe_finished(self, state: RequestState) -> None:
        """Record one finished engine request (called on the engine client's receiver thread). Its
        ``status_code`` is its call's answer: 200; 499 cancelled by the client; 400 its input cannot be served
        (a grammar that allows no token); 503 failed (a fault past its migrations, ``api.timeout_ms``). A
        stream that fails after its 200 counts its error event's status."""
        reason = "abort" if state.aborted else state.finish_reason or "unknown"
        if reason in ("stop", "length"):
            code = "200"
        elif state.failure is None:
            code = "499"
        else:
            code = "400" if state.invalid_input else "503"
        self.requests.labels(finish_reason=reason, status_code=code).inc()
        if state.counts_inputs:  # a call's choices share its prompt: counted once
            self.prompt_tokens.inc(state.num_prompt_tokens)
            self.images.inc(state.num_images)
        self.generation_tokens.inc(len(state.token_ids))
        if state.first_token_time is None:
            return
        self.ttft.observe(state.first_token_time - state.arrival_time)
        times = state.token_times
        for earlier, later in zip(times, times[1:], strict=False):
            self.itl.observe(later - earlier)
        if code == "200":  # a request cut short (client gone, failed) has no whole answer to time
            if len(times) > 1:
                self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))
            self.e2e.observe((state.finish_time or times[-1]) - state.arrival_time)
        self._observe_events(state.events, state.num_images > 0)

    def _observe_events(self, events: dict[str, float], encoded: bool) -> None:
        """The stage histograms from a request's lifetime events (``encoded``: it had images or videos;
        a text-only request's empty encode span is not an encode)."""
        targets = {"encode": self.encode, "prefill": self.prefill, "handoff": self.handoff}
        for kind, begin, end, stage in _EVENT_SPANS:
            if kind == "encode" and not encoded:
                continue
            if begin.value in events and end.value in events:
                seconds = max(0.0, events[end.value] - events[begin.value])
                if kind == "queue":
                    self.queue.labels(stage=stage).observe(seconds)
                else:
                    targets[kind].observe(seconds)

    def observe_rejected(self, status_code: int) -> None:
        """Count a request refused before it reached a worker (4xx/5xx)."""
        self.requests.labels(finish_reason="error", status_code=str(status_code)).inc()


_WORKER_GAUGES = {
    "requests_running": ("running", "Requests running (decoding, or pending hand-off on prefill)."),
    "requests_waiting": ("waiting", "Requests queued."),
    "kv_pages_used": ("kv_pages_used", "KV pages in use."),
    "kv_pages_total": ("kv_pages_total", "KV pages in the worker's pool."),
    "ring_slots_used": ("ring_slots_used", "Hand-off ring slots published and not yet released by decode."),
}
_WORKER_COUNTERS = {"preemptions": ("num_preemptions", "Requests preempted (KV recomputed).")}
_CACHE_GAUGES = {
    "kv_cached_pages": ("kv_cached_pages", "KV pages carrying a prefix-cache hash (in use or free, reusable)."),
    "encoder_cache_bytes": ("encoder_cache_bytes", "Bytes of image embeddings in the encoder cache."),
}
_CACHE_COUNTERS = {
    "prefix_cache_queried_tokens": ("prefix_queried_tokens", "Prompt tokens of requests looked up in the prefix cache."),
    "prefix_cache_hit_tokens": ("prefix_hit_tokens", "Prompt tokens whose KV was reused from the prefix cache."),
    "kv_cache_evictions": ("kv_evictions", "Cached KV pages evicted (reused for other content)."),
    "encoder_cache_hits": ("encoder_cache_hits", "Images whose embeddings came from the encoder cache."),
    "encoder_cache_misses": ("encoder_cache_misses", "Images looked up in the encoder cache and encoded."),
    "encoder_cache_evictions": ("encoder_cache_evictions", "Encoder-cache entries dropped for room."),
}


def _per_worker(stats: dict[tuple[str, int], Any], gauges: dict[str, tuple[str, str]],
                counters: dict[str, tuple[str, str]]) -> Iterator[Any]:
    """One family per entry (``name -> (WorkerStats field, doc)``), one sample per worker."""
    rows = sorted(stats.items())
    for kind, table in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
        for name, (field, doc) in table.items():
            family = kind(f"mm_serve_{name}", doc, labels=["worker"])
            for (role, index), s in rows:
                family.add_metric([f"{role}{index}"], float(getattr(s, field)))
            yield family


class WorkerStatsCollector(Collector):
    """Per-worker gauges and counters from the latest worker stats, at scrape time; the prefix-
    and encoder-cache figures of the workers that have the caches (prefill and colocated)."""

    def __init__(self, stats_source: Any) -> None:
        self._source = stats_source  # callable returning {(role, index): WorkerStats}

    def collect(self) -> Iterator[Any]:
        stats = self._source()
        yield from _per_worker(stats, _WORKER_GAUGES, _WORKER_COUNTERS)
        caching = {k: s for k, s in stats.items() if k[0] != "decode"}
        yield from _per_worker(caching, _CACHE_GAUGES, _CACHE_COUNTERS)
        rate = GaugeMetricFamily("mm_serve_prefix_cache_hit_rate", "Prefix-cache hit rate in prompt tokens since "
                                 "the worker started (hit / queried).", labels=["worker"])
        for (role, index), s in sorted(caching.items()):
            rate.add_metric([f"{role}{index}"], s.prefix_hit_tokens / s.prefix_queried_tokens if s.prefix_queried_tokens else 0.0)
        yield rate


def cache_health(stats: dict[tuple[str, int], Any]) -> dict[str, dict[str, float | int]]:
    """``/health``'s ``caches``: per prefill (or colocated) worker, ``kv_cache_hit_rate`` (prompt
    tokens whose KV was reused / prompt tokens, since it started), ``kv_cached_pages``,
    ``encoder_cache_hit_rate`` (images) and ``encoder_cache_bytes``, from its latest stats."""
    out = {}
    for (role, index), s in sorted(stats.items()):
        if role == "decode":
            continue
        looked_up = s.encoder_cache_hits + s.encoder_cache_misses
        out[f"{role}{index}"] = {
            "kv_cache_hit_rate": round(s.prefix_hit_tokens / s.prefix_queried_tokens, 4) if s.prefix_queried_tokens else 0.0,
            "kv_cached_pages": s.kv_cached_pages,
            "encoder_cache_hit_rate": round(s.encoder_cache_hits / looked_up, 4) if looked_up else 0.0,
            "encoder_cache_bytes": s.encoder_cache_bytes,
        }
    return out


_FAULT_COUNTERS = (
    ("worker_restarts", "Worker restarts after an exit or a hang, by role."),
    ("request_migrations", "Requests moved to another worker (re-prefilled) after a fault of a worker of this role."),
    ("handoff_failures", "Hand-offs a decode worker refused (bad version, checksum or meta); each was re-prefilled."),
    ("requests_failed_by_fault", "Requests ended with an error by a fault (past fault.max_migrations, or no worker left)."),
)


class FaultCollector(Collector):
    """Fault counters by role and per-worker readiness, read at scrape time.

    ``source()`` returns ``(counts, workers)``: ``counts`` maps ``(kind, role)`` to a count,
    kinds as in :data:`_FAULT_COUNTERS` (``worker_restarts``, ``request_migrations``,
    ``handoff_failures``, ``requests_failed_by_fault``); ``workers`` maps a worker name to its
    status (``ready | warming | restarting | down``).
    """

    def __init__(self, source: Any) -> None:
        self._source = source

    def collect(self) -> Iterator[Any]:
        counts, workers = self._source()
        roles = sorted({role for _, role in counts} | {"prefill", "decode"})
        for kind, doc in _FAULT_COUNTERS:
            family = CounterMetricFamily(f"mm_serve_{kind}", doc, labels=["role"])
            for role in roles:
                family.add_metric([role], float(counts.get((kind, role), 0)))
            yield family
        ready = GaugeMetricFamily("mm_serve_worker_ready", "1 when the worker is ready, else 0 (warming, "
                                  "restarting, down).", labels=["worker"])
        for name, status in sorted(workers.items()):
            ready.add_metric([name], 1.0 if status == "ready" else 0.0)
        yield ready


def render(registry: CollectorRegistry) -> bytes:
    """The text exposition format of ``registry``."""
    return generate_latest(registry)
