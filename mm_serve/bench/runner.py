"""One system under test: runs of the workload at given rates, and its unloaded latencies.

:class:`LoadRunner` turns a rate (requests/s) into a run plan (the workload's first
``n`` requests on the seeded arrival path scaled to that rate), sends it with the
client, and summarises the records against the SLO. Every rate replays the same
requests and the same arrival path (common random numbers), with text and images
salted by the rate so that no cache carries over between runs. A conversational
workload's runs hold whole conversations, started on the arrival path
(:mod:`mm_serve.bench.conversations`). Around every run the server's cache counters
are read from ``/metrics`` (:mod:`mm_serve.bench.server_metrics`), when it has them.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from mm_serve.bench.client import Endpoint, run_load, run_sequential
from mm_serve.bench.conversations import conversation_arrivals, whole_conversations
from mm_serve.bench.metrics import RunSummary, summarize
from mm_serve.bench.records import RequestRecord
from mm_serve.bench.requests import PlannedRequest, RequestFactory
from mm_serve.bench.server_metrics import counter_delta, scrape, scrape_after
from mm_serve.ground.slo import SLO
from mm_serve.workloads import (
    JsonlWorkload,
    RequestSpec,
    Workload,
    WorkloadError,
    trace_arrivals,
    unit_rate_arrivals,
)
from mm_serve.workloads.spec import conversation_groups


@dataclass(frozen=True)
class LoadSpec:
    """What every run sends: the workload, its seed and how many requests a run has."""

    workload: Workload
    seed: int = 0
    duration_s: float = 60.0  # seconds of arrivals per run (n = rate * duration_s)
    num_requests: int | None = None  # requests per run; overrides duration_s (see count_at)
    min_requests: int = 10  # floor on n at low rates (see count_at)
    burstiness: float = 1.0  # coefficient of variation of the gaps; 1 = Poisson
    content_salt: int = 0  # runs at one rate with different salts send the same shapes and times, other content

    def __post_init__(self) -> None:
        if self.duration_s <= 0:
            raise WorkloadError(f"duration must be > 0 s, got {self.duration_s}")
        if self.num_requests is not None and self.num_requests < 1:
            raise WorkloadError(f"number of requests must be >= 1, got {self.num_requests}")
        if self.burstiness <= 0:
            raise WorkloadError(f"burstiness (CV) must be > 0, got {self.burstiness}")

    def count_at(self, rate: float) -> int:
        """Requests in a run at ``rate`` requests/s: ``num_requests``, else ``rate * duration_s``
        but at least ``min_requests``; either way no more than arrive in ``3 * duration_s``
        (so that a search that wanders to low rates stays short), and at least one."""
        span_cap = max(1, math.ceil(rate * 3 * self.duration_s))
        if self.num_requests is not None:
            return min(self.num_requests, span_cap)
        return min(span_cap, max(self.min_requests, math.ceil(rate * self.duration_s)))


class LoadRunner:
    """Runs the workload against one endpoint and summarises each run against ``slo``.

    ``slo`` may be None until it is known (e.g. derived from :meth:`unloaded`);
    :meth:`run_at` needs it. ``on_run`` (optional) is called with every summary as soon as it exists, for
    progress output; ``records_path`` (optional) receives every request of every run
    as a JSON line (with its run's ``rate``). ``early_stop`` cuts an overloaded run short once attainment
    below ``target`` is certain (see :func:`mm_serve.bench.client.run_load`).
    """

    def __init__(self, endpoint: Endpoint, factory: RequestFactory, load: LoadSpec, slo: SLO | None,
                 target: float, early_stop: bool = True,
                 on_run: Callable[[RunSummary], None] | None = None,
                 records_path: Path | None = None,
                 on_records: Callable[[float, list[RequestRecord]], None] | None = None) -> None:
        self.endpoint = endpoint
        self.factory = factory
        self.load = load
        self.slo = slo
        self.target = target
        self.early_stop = early_stop
        self.on_run = on_run
        self.records_path = records_path
        self.on_records = on_records  # (rate, records) of every loaded run, after on_run
        self._specs: list[RequestSpec] = []

    def _specs_for(self, n: int) -> list[RequestSpec]:
        """The workload's first ``n`` requests (the same prefix for every ``n``), completed to
        a whole conversation for a conversational workload."""
        if len(self._specs) < n:
            self._specs = self.load.workload.sample(max(n, 2 * len(self._specs)), self.load.seed)
        return whole_conversations(self._specs, n)

    def plan_at(self, rate: float) -> list[PlannedRequest]:
        """The run plan at ``rate`` requests/s (bodies built now, before any clock starts)."""
        if not (rate > 0 and math.isfinite(rate)):
            raise WorkloadError(f"rate must be a positive number of requests/s, got {rate}")
        specs = self._specs_for(self.load.count_at(rate))
        workload = self.load.workload
        if isinstance(workload, JsonlWorkload) and workload.is_trace:
            arrivals = trace_arrivals(specs, rate)
        else:  # one start per conversation (per request outside conversations)
            starts = len(conversation_groups([s.conversation_id for s in specs]))
            unit = unit_rate_arrivals(starts, self.load.seed, self.load.burstiness)
            # the first start at once (its gap from 0 is ~1 / rate: 24 days at 1e-6 requests/s), the
            # rest as the path has them: a run plans no arrival past (count - 1) / rate
            arrivals = conversation_arrivals(specs, [t - unit[0] for t in unit], rate)
        # content differs between rates (and salts), so no run is served from another's prefix or encoder cache
        return self.factory.plan(specs, arrivals, salt=round(rate * 1e6) + 1_000_003 * self.load.content_salt)

    def run_at(self, rate: float) -> RunSummary:
        """Send the run at ``rate`` requests/s and summarise it."""
        if self.slo is None:
            raise ValueError("set the runner's SLO before a loaded run")
        plan = self.plan_at(rate)
        before = scrape(self.endpoint.base_url, self.endpoint.api_key)
        result = asyncio.run(run_load(self.endpoint, plan, self.slo if self.early_stop else None, self.target))
        counters = counter_delta(before, scrape_after(self.endpoint.base_url, self.endpoint.api_key, before))
        summary = replace(summarize(result.records, rate, self.slo, result.stopped_early), server_counters=counters)
        self._save(rate, result.records)
        if self.on_run is not None:
            self.on_run(summary)
        if self.on_records is not None:
            self.on_records(rate, result.records)
        return summary

    def unloaded(self, num_requests: int = 8) -> RunSummary:
        """Latencies of ``num_requests`` workload requests sent one at a time (rate reported as 0).

        The first request is sent twice and its first copy dropped, as a warm-up (alone:
        outside its conversation, with an image of its own). A conversational workload
        sends whole conversations, so a few more requests than asked. The server's counter
        deltas include the warm-up.
        """
        specs = self._specs_for(num_requests)
        warm = replace(specs[0], conversation_id=None, turn=0, image_seed=None)
        plan = self.factory.plan([warm, *specs], [0.0] * (len(specs) + 1), salt=-1 - self.load.content_salt)
        before = scrape(self.endpoint.base_url, self.endpoint.api_key)
        records = asyncio.run(run_sequential(self.endpoint, plan))[1:]
        counters = counter_delta(before, scrape_after(self.endpoint.base_url, self.endpoint.api_key, before))
        self._save(0.0, records)
        return replace(summarize(records, 0.0, self.slo), server_counters=counters)

    def _save(self, rate: float, records: list[RequestRecord]) -> None:
        if self.records_path is None:
            return
        self.records_path.parent.mkdir(parents=True, exist_ok=True)
        with self.records_path.open("a") as f:
            for rec in records:
                f.write(json.dumps({"rate": rate, **rec.row()}) + "\n")
