"""Goodput of candidate instances and units, by simulation, memoised per config.

DistServe's ``simu_prefill`` / ``simu_decode`` (Algorithm 1): the prefill-only
goodput of a config is the highest rate at which the TTFT SLO is met by the target
fraction of requests, the decode-only goodput the same for TPOT. A colocated
instance and a whole disaggregated unit are judged on both SLOs at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
TURNOVERS = 10  # simulated requests per request the system holds at once
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
        self.max_prompt = max(prompts)
        self.max_context = max(p + s.output_tokens for p, s in zip(prompts, self.specs, strict=True))
        self._cache: dict[tuple[object, ...], float] = {}
        self.simulations = 0

    def sim_size(self, concurrency: float) -> tuple[int, int]:
        """Requests to simulate and warm-up requests to skip for a system holding
        about ``concurrency`` requests at once.

        A finite run only reveals overload once the backlog outgrows what the SLO
        slack absorbs, so the run covers ``TURNOVERS`` times the concurrency (at least
        ``num_requests``; at most the ``max(num_requests, MAX_REQUESTS)`` requests
        drawn) and ignores the first turnover, whose requests found the system empty.
        """
        c = max(1, int(concurrency))
        n = min(len(self.specs), max(self.spec.num_requests, TURNOVERS * c))
        return n, min(c, n // 4)

    # ---- servers ---------------------------------------------------------------
    def memory(self, par: ParallelConfig, vision: bool) -> MemoryPlan:
        return memory_plan(self.spec.shape, self.spec.hardware, par, vision)

    def prefill_server(self, par: ParallelConfig, cross_node: bool) -> PrefillServer:
        s = self.spec
        return PrefillServer(self.model.prefill_timing(par, cross_node), s.prefill_token_budget,
                             s.prefill_max_batch)

    def decode_server(self, par: ParallelConfig, cross_node: bool, vision: bool = False) -> DecodeServer:
        cap = self.memory(par, vision).kv_capacity_tokens
        return DecodeServer(self.model.decode_timing(par, cross_node), cap, self.spec.decode_max_batch)

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
    ) -> float:
        """``near``: ``upper`` comes from simulated goodputs, so the answer is close to
        it and the first floor is ``upper / NEAR_SPAN`` (about 7 probes instead of 10).
        ``timings``: the (prefill, decode) timings judged; 0 without simulating when
        even an idle instance misses the target (see :meth:`alone_attainment`)."""
        n, skip = self.sim_size(concurrency)
        if timings is not None and self.alone_attainment(n, *timings, skip) < self.spec.attainment:
            return 0.0

        def attainment(rate: float) -> float:
            self.simulations += 1
            with gc_paused():  # the probe's requests and events, not only the loop
                return run(self.requests(rate, n)).attainment(self.spec.slo, phase, skip)

        if near:
            return max_rate(attainment, self.spec.attainment, upper, span=NEAR_SPAN,
                            max_shrink=NEAR_SHRINKS)
        return max_rate(attainment, self.spec.attainment, upper)

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
            timings=(server.timing, None)))

    def decode_goodput(self, par: ParallelConfig, cross_node: bool) -> float:
        """Max rate one decode instance serves within the TPOT SLO."""
        server = self.decode_server(par, cross_node)
        return self._memo(("decode", par, cross_node), lambda: self._search(
            lambda reqs: simulate_decode(server, reqs), "decode",
            self.decode_bound(par, cross_node), self.decode_concurrency(server),
            timings=(None, server.timing)))

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
        return self._memo(("colocated", par, cross_node, replicas, tokens), lambda: self._search(
            lambda reqs: simulate_colocated(prefill, server, budget, reqs, replicas, mixed), "both",
            bound, replicas * self.decode_concurrency(server), near, (prefill, server.timing)))

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
            _BOUND_SLACK * upper, held, near=True)

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
