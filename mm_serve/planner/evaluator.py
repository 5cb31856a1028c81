"""Goodput of candidate instances and units, by simulation, memoised per config.

DistServe's ``simu_prefill`` / ``simu_decode`` (Algorithm 1): the prefill-only
goodput of a config is the highest rate at which the TTFT SLO is met by the target
fraction of requests, the decode-only goodput the same for TPOT. A colocated
instance and a whole disaggregated unit are judged on both SLOs at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from mm_serve.planner.colocated_instance import MixedSteps
from mm_serve.planner.events import gc_paused
from mm_serve.planner.goodput import max_rate
from mm_serve.planner.latency_model import DecodeTiming, LatencyModel, ParallelConfig, PrefillTiming
from mm_serve.planner.memory import MemoryPlan, memory_plan
from mm_serve.planner.plan_spec import PlanSpec
from mm_serve.planner.shared_core import PacedDecodeTiming, SharedCorePlacement
from mm_serve.planner.sim_request import SimRequest
from mm_serve.planner.sim_result import Phase, SimResult
from mm_serve.planner.simulator import (
    DecodeServer,
    Handoff,
    PrefillServer,
    build_requests,
    simulate_colocated,
    simulate_decode,
    simulate_disaggregated,
    simulate_prefill,
)
from mm_serve.workloads import (
    JsonlWorkload,
    RequestSpec,
    trace_arrivals,
    unit_rate_arrivals,
)

_BOUND_SLACK = 1.25  # analytic throughput bounds are approximate; probe above them
NEAR_SPAN = 2.0  # search floor below a simulated estimate (not an analytic bound)
NEAR_SHRINKS = 24  # floors tried below it: down to NEAR_SPAN ** -24 (as far as 64 ** -4)
TURNOVERS = 10  # simulated requests per request the system holds at once (or its SLO slack absorbs)
MAX_REQUESTS = 20_000  # cap on simulated requests per probe


class GoodputEvaluator:
    """Simulates candidates for one :class:`PlanSpec`; caches goodputs (requests/s)."""

    def __init__(self, spec: PlanSpec) -> None:
        self.spec = spec
        self.model = LatencyModel(spec.shape, spec.hardware)
        n = max(spec.num_requests, MAX_REQUESTS)
        self.specs: list[RequestSpec] = spec.workload.sample(n, spec.seed)
        if isinstance(spec.workload, JsonlWorkload) and spec.workload.is_trace:
            self._unit_arrivals = trace_arrivals(self.specs, rate=1.0)
        else:
            self._unit_arrivals = unit_rate_arrivals(n, spec.seed, spec.burstiness)
        prompts = [s.total_prompt_tokens for s in self.specs]
        self.mean_prompt = sum(prompts) / n
        self.mean_prompt_sq = sum(p * p for p in prompts) / n
        self.mean_images = sum(s.num_images for s in self.specs) / n
        self.mean_output = sum(s.output_tokens for s in self.specs) / n
        self.image_share = sum(1 for s in self.specs if s.num_images > 0) / n  # requests with an image
        steps = [max(s.output_tokens - 1, 0) for s in self.specs]  # decode steps after the first token
        self.mean_decode_steps = sum(steps) / n
        self.mean_decode_context = sum(k * p for k, p in zip(steps, prompts, strict=True)) / n  # KV tokens read, at least
        self.max_prompt = max(prompts)
        self.max_context = max(p + s.output_tokens for p, s in zip(prompts, self.specs, strict=True))
        self._cache: dict[tuple[object, ...], float] = {}
        self.simulations = 0

    def sim_size(self, concurrency: float, backlog: float = 0.0) -> tuple[int, int]:
        """Requests to simulate and warm-up requests to skip for a system holding
        about ``concurrency`` requests at once whose SLO slack absorbs a queue of about
        ``backlog`` requests (:meth:`slack_backlog`).

        A finite run only reveals overload once the backlog outgrows what the SLO
        slack absorbs, so the run covers ``TURNOVERS`` times the larger of the two (at
        least ``num_requests``; at most the ``max(num_requests, MAX_REQUESTS)`` requests
        drawn) and ignores the first turnover, whose requests found the system empty.
        A run too short for the slack passes at any rate: a fast model under a loose SLO
        clears its whole run within the TTFT SLO even when every request arrives at once.
        """
        c = max(1, int(concurrency))
        held = max(c, int(min(backlog, len(self.specs))))
        n = min(len(self.specs), max(self.spec.num_requests, TURNOVERS * held))
        return n, min(c, n // 4)

    def slack_s(self, phase: Phase) -> float:
        """Seconds a request can wait in a queue and still meet the SLOs ``phase`` judges, at
        most: the TTFT SLO before its first token, and the TPOT SLO times the decode steps of a
        mean answer before its decode steps (a wait there counts in its TPOT)."""
        slo = self.spec.slo
        decode = slo.tpot_s * max(self.mean_output - 1, 1.0)
        if phase == "prefill":
            return slo.ttft_s
        if phase == "decode":
            return decode
        return max(slo.ttft_s, decode)

    def slack_backlog(self, phase: Phase, capacity: float) -> float:
        """Requests a system completing at most ``capacity`` requests/s clears within
        :meth:`slack_s` (0 for an unbounded capacity: the run is sized by its concurrency)."""
        return capacity * self.slack_s(phase) if math.isfinite(capacity) else 0.0

    # ---- servers ---------------------------------------------------------------
    def memory(self, par: ParallelConfig, vision: bool) -> MemoryPlan:
        return memory_plan(self.spec.shape, self.spec.hardware, par, vision)

    def prefill_server(self, par: ParallelConfig, cross_node: bool) -> PrefillServer:
        s = self.spec
        return PrefillServer(self.model.prefill_timing(par, cross_node), s.prefill_token_budget,
                             s.prefill_max_batch)

    def decode_server(self, par: ParallelConfig, cross_node: bool, vision: bool = False) -> DecodeServer:
        """A decode (or colocated) instance of ``par``. With the spec's ``front_end_s_per_token`` above 0,
        an instance of tensor-parallel degree above 1 without pipeline stages (on a CPU: one worker on as
        many threads, every core of a colocated instance) pays it per sequence in each step: its threads run each layer in lockstep, so the time
        the front end takes from any of its cores, to stream that step's tokens, stalls the whole step
        (``d + f * batch`` for a step of ``d`` seconds alone). A one-thread worker pays nothing: the front
        end runs on another core. Measured on a 2-core Xeon, colocated under chatbot load: the steps
        exceeded their profiled time by 0.34-0.40 ms per sequence, against 0.28 ms of front-end CPU per
        token (API process and bench client) and 0.05 ms of the engine's own per-token work
        (``benchmarks/results/2026-12-07-colocated-front-end-stall.md``)."""
        cap = self.memory(par, vision).kv_capacity_tokens
        timing = self.model.decode_timing(par, cross_node, self.spec.front_end_s_per_token)
        return DecodeServer(timing, cap, self.spec.decode_max_batch)

    def handoff(self, prefill: ParallelConfig, decode: ParallelConfig, cross_node: bool) -> Handoff:
        """KV link of a pair: parallel streams = the smaller instance's GPU count."""
        one = self.model.kv_transfer_time(1, min(prefill.gpus, decode.gpus), cross_node)
        const = self.spec.hardware.collective_latency_s
        return Handoff(const, one - const)

    # ---- analytic bounds (requests/s) and concurrency (requests) --------------
    def prefill_batch(self) -> int:
        """Average-request count of a full token-budget prefill batch."""
        k = int(self.spec.prefill_token_budget // self.mean_prompt)
        return max(1, min(self.spec.prefill_max_batch, k))

    def prefill_bound(self, par: ParallelConfig, cross_node: bool) -> float:
        """Throughput with full token-budget batches of average requests."""
        timing = self.model.prefill_timing(par, cross_node)
        k = self.prefill_batch()
        dt = timing.stage_time(k * self.mean_prompt, k * self.mean_prompt_sq, k, k * self.mean_images)
        return _BOUND_SLACK * k / dt

    def decode_concurrency(self, server: DecodeServer) -> int:
        """Average requests a full decode batch holds (``max_batch`` or KV bound)."""
        final = self.mean_prompt + self.mean_output
        return max(1, min(server.max_batch, int(server.kv_capacity // final)))

    def decode_bound(self, par: ParallelConfig, cross_node: bool, vision: bool = False) -> float:
        """Throughput with the running batch as full as KV and ``max_batch`` allow."""
        server = self.decode_server(par, cross_node, vision)
        batch = self.decode_concurrency(server)
        step = server.timing.step_time(batch, batch * (self.mean_prompt + self.mean_output / 2))
        steps = max(self.mean_output - 1, 1.0)
        return _BOUND_SLACK * batch / (step * steps)

    # ---- capacities: hard ceilings on goodput (requests/s) ------------------------
    # The most requests/s the profiled step times allow, whatever the arrivals: every batch or
    # step constant split over the largest batch, every request's own work in full. A goodput
    # search never answers more (see :func:`~mm_serve.planner.goodput.max_rate`'s ``ceiling``).

    def prefill_capacity(self, server: PrefillServer) -> float:
        """Requests/s ``server`` prefills at most: per request of the workload, its tokens',
        squared length's, sequence's and images' share of a batch's stage time, plus the batch
        constant (and the vision encoder's, for requests with an image) split over
        ``max_batch`` requests (inf if that costs no time)."""
        t = server.timing
        own = (t.per_token * self.mean_prompt + t.per_token_sq * self.mean_prompt_sq + t.per_seq
               + t.per_image * self.mean_images)
        shared = (t.const + t.encode_const * self.image_share) / server.max_batch
        seconds = own + shared
        return 1.0 / seconds if seconds > 0 else math.inf

    def decode_capacity(self, server: DecodeServer, step_constant: bool = True) -> float:
        """Requests/s ``server`` decodes at most: its tokens/s with the running batch always full
        (``max_batch`` requests reading at least their prompts' KV, its timing's step, paced or
        shared as that timing is), over the decode steps of a mean answer (inf if a step costs
        no time or no answer decodes). ``step_constant`` False: the step's constants left out
        (a colocated engine's mixed step pays them in its prefill pass)."""
        if self.mean_decode_steps == 0:
            return math.inf
        timing = server.timing if step_constant else replace(server.timing, stage_const=0.0, hop_const=0.0)
        batch = server.max_batch
        step = timing.step_time(batch, batch * self.mean_decode_context / self.mean_decode_steps)
        return batch / (step * self.mean_decode_steps) if step > 0 else math.inf

    def colocated_capacity(self, par: ParallelConfig, cross_node: bool, replicas: int, mixed: bool) -> float:
        """Requests/s ``replicas`` colocated instances of ``par`` serve at most: each does both
        phases' work (``mixed``: mixed steps, whose decode rows pay no step constant)."""
        prefill = self.prefill_capacity(self.prefill_server(par, cross_node))
        decode = self.decode_capacity(self.decode_server(par, cross_node, vision=True), step_constant=not mixed)
        return replicas / (1.0 / prefill + 1.0 / decode)

    def unit_capacity(self, prefills: Sequence[PrefillServer], decodes: Sequence[DecodeServer]) -> float:
        """Requests/s a disaggregated unit serves at most: the lesser of its prefill instances'
        capacities together and its decode instances' together."""
        return min(sum(self.prefill_capacity(p) for p in prefills), sum(self.decode_capacity(d) for d in decodes))

    # ---- simulated goodputs (requests/s) ----------------------------------------
    def requests(self, rate: float, n: int) -> list[SimRequest]:
        """The first ``n`` drawn requests, arriving at mean ``rate`` requests/s."""
        return build_requests(self.specs[:n], [t / rate for t in self._unit_arrivals[:n]])

    def alone_attainment(
        self, n: int, prefill: PrefillTiming | None, decode: DecodeTiming | None, skip: int = 0
    ) -> float:
        """Share of requests ``skip .. n-1`` (those a probe scores) that would meet the
        SLOs with the instance to themselves (no queue, no batch): TTFT = the prompt's
        prefill latency, TPOT = :meth:`DecodeTiming.min_step_time` at the prompt's context
        (a lower bound on each of its steps in any batch).

        Load only adds waiting and batch work, so a config whose attainment here is
        below the target has goodput 0 at any rate, and needs no simulation (low-rate
        probes are the slowest ones: every request decodes alone for its whole answer).
        ``prefill`` None: TTFT not judged; ``decode`` None: TPOT not judged.
        """
        slo, ok = self.spec.slo, 0
        scored = self.specs[skip:n]
        for s in scored:
            p = s.total_prompt_tokens
            if prefill is not None and prefill.latency(p, p * p, 1, s.num_images) > slo.ttft_s:
                continue
            if decode is not None and s.output_tokens > 1 and decode.min_step_time(p) > slo.tpot_s:
                continue
            ok += 1
        return ok / max(1, len(scored))

    def _search(
        self,
        run: Callable[[list[SimRequest]], SimResult],
        phase: Phase,
        upper: float,
        concurrency: float = 1.0,
        near: bool = False,
        timings: tuple[PrefillTiming | None, DecodeTiming | None] | None = None,
        capacity: float = math.inf,
    ) -> float:
        """``near``: ``upper`` comes from simulated goodputs, so the answer is close to
        it and the first floor is ``upper / NEAR_SPAN`` (about 7 probes instead of 10).
        ``timings``: the (prefill, decode) timings judged; 0 without simulating when
        even an idle instance misses the target (see :meth:`alone_attainment`).
        ``capacity``: the system's most requests/s (the ``*_capacity`` methods): the answer's
        ceiling, and with the SLO slack the length of each probe's run (:meth:`sim_size`)."""
        n, skip = self.sim_size(concurrency, self.slack_backlog(phase, capacity))
        if timings is not None and self.alone_attainment(n, *timings, skip) < self.spec.attainment:
            return 0.0

        def attainment(rate: float) -> float:
            self.simulations += 1
            with gc_paused():  # the probe's requests and events, not only the loop
                return run(self.requests(rate, n)).attainment(self.spec.slo, phase, skip)

        if near:
            return max_rate(attainment, self.spec.attainment, upper, span=NEAR_SPAN,
                            max_shrink=NEAR_SHRINKS, ceiling=capacity)
        return max_rate(attainment, self.spec.attainment, upper, ceiling=capacity)

    def _memo(self, key: tuple[object, ...], compute: Callable[[], float]) -> float:
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def prefill_goodput(self, par: ParallelConfig, cross_node: bool) -> float:
        """Max rate one prefill instance serves within the TTFT SLO."""
        server = self.prefill_server(par, cross_node)
        return self._memo(("prefill", par, cross_node), lambda: self._search(
            lambda reqs: simulate_prefill(server, reqs), "prefill",
            self.prefill_bound(par, cross_node), self.prefill_batch() * par.pp,
            timings=(server.timing, None), capacity=self.prefill_capacity(server)))

    def decode_goodput(self, par: ParallelConfig, cross_node: bool) -> float:
        """Max rate one decode instance serves within the TPOT SLO."""
        server = self.decode_server(par, cross_node)
        return self._memo(("decode", par, cross_node), lambda: self._search(
            lambda reqs: simulate_decode(server, reqs), "decode",
            self.decode_bound(par, cross_node), self.decode_concurrency(server),
            timings=(None, server.timing), capacity=self.decode_capacity(server)))

    def colocated_goodput(self, par: ParallelConfig, cross_node: bool, replicas: int = 1,
                          mixed_tokens: int | None = None) -> float:
        """Max rate ``replicas`` colocated instances (shortest-queue dispatch) serve
        within both SLOs, requests/s in all. For ``replicas > 1`` the search starts
        from ``replicas`` times one instance's simulated goodput. ``mixed_tokens``: their
        mixed-step budget (None: the spec's ``colocated_mixed_tokens``; 0: prefill steps apart;
        with pipeline stages, always 0)."""
        prefill = self.model.prefill_timing(par, cross_node)
        server = self.decode_server(par, cross_node, vision=True)
        budget = self.spec.prefill_token_budget
        spec = self.spec
        tokens = spec.colocated_mixed_tokens if mixed_tokens is None else mixed_tokens
        tokens = 0 if par.pp > 1 else tokens
        mixed = MixedSteps(tokens, spec.prefill_max_batch, spec.page_size) if tokens else None
        single = self.colocated_goodput(par, cross_node, mixed_tokens=tokens) if replicas > 1 else 0.0
        near = single > 0
        if near:
            bound = _BOUND_SLACK * replicas * single
        else:
            bound = replicas / (1.0 / self.prefill_bound(par, cross_node)
                                + 1.0 / self.decode_bound(par, cross_node, vision=True))
        capacity = self.colocated_capacity(par, cross_node, replicas, mixed is not None)
        return self._memo(("colocated", par, cross_node, replicas, tokens), lambda: self._search(
            lambda reqs: simulate_colocated(prefill, server, budget, reqs, replicas, mixed), "both",
            bound, replicas * self.decode_concurrency(server), near, (prefill, server.timing), capacity))

    def disaggregated_goodput(
        self,
        prefills: Sequence[PrefillServer],
        decodes: Sequence[DecodeServer],
        handoff: Sequence[Sequence[Handoff]],
        upper: float,
        shared: tuple[int, int] | None = None,
    ) -> float:
        """Max rate a whole disaggregated unit serves within both SLOs; ``upper`` is
        its phase estimate ``min(n Gp, m Gd)`` from simulated phase goodputs
        (requests/s). ``shared``: the (prefill, decode) pair on one core
        (:func:`~mm_serve.planner.simulator.simulate_disaggregated`)."""
        held = sum(self.decode_concurrency(d) for d in decodes)
        held += self.prefill_batch() * sum(p.timing.pp for p in prefills)
        return self._search(
            lambda reqs: simulate_disaggregated(prefills, decodes, handoff, reqs, shared), "both",
            _BOUND_SLACK * upper, held, near=True, capacity=self.unit_capacity(prefills, decodes))

    def shared_core_goodput(self, placement: SharedCorePlacement, share: float) -> float:
        """Max rate (requests/s) ``placement`` serves within both SLOs: one-core prefill and
        decode instances, the decode instance paced at ``placement.pacing`` × the TPOT SLO and
        given ``share`` of the core it shares with the last prefill instance
        (:mod:`mm_serve.planner.shared_core`)."""
        one = ParallelConfig(1, 1)
        prefill, alone = self.prefill_server(one, False), self.decode_server(one, False)
        paced = PacedDecodeTiming(**vars(alone.timing), interval_s=placement.pacing * self.spec.slo.tpot_s,
                                  share=share)
        decode = DecodeServer(paced, alone.kv_capacity, alone.max_batch)
        n, link = placement.cores, self.handoff(one, one, False)
        return self._memo(("shared", placement, share), lambda: self.disaggregated_goodput(
            [prefill] * n, [decode], [[link]] * n, n * self.prefill_goodput(one, False), shared=(n - 1, 0)))
