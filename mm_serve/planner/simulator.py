"""Discrete-event simulation of prefill-only, decode-only, colocated and
disaggregated serving (DistServe §4.1 "simulator", here event-driven).

Requests arrive at given times; a dispatcher sends each to the instance with the
shortest queue (fewest requests queued or in service, lowest index on ties; for
colocated instances, queued or decoding: see ``ColocatedInstance.load``). In the
disaggregated system a prefilled request's KV then crosses the hand-off link of its
(prefill, decode) pair (a FIFO link, so hand-offs queue behind each other) and joins
the chosen decode instance's FCFS queue (DistServe §4.3: decode pulls the KV when it
has room; the request waits with its KV on the prefill side meanwhile, which this
model does not charge to prefill memory).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from mm_serve.planner.colocated_instance import ColocatedInstance, MixedSteps
from mm_serve.planner.decode_instance import DecodeInstance
from mm_serve.planner.events import EventLoop
from mm_serve.planner.latency_model import DecodeTiming, PrefillTiming
from mm_serve.planner.prefill_instance import PrefillInstance
from mm_serve.planner.shared_core import PacedDecodeTiming, prefill_slowdown
from mm_serve.planner.sim_request import SimRequest
from mm_serve.planner.sim_result import SimResult
from mm_serve.workloads import RequestSpec


@dataclass(frozen=True)
class PrefillServer:
    """Simulation parameters of one prefill instance."""

    timing: PrefillTiming
    token_budget: int  # prompt tokens per batch
    max_batch: int  # requests per batch


@dataclass(frozen=True)
class DecodeServer:
    """Simulation parameters of one decode (or colocated) instance."""

    timing: DecodeTiming
    kv_capacity: int  # KV tokens
    max_batch: int  # running requests


@dataclass(frozen=True)
class Handoff:
    """KV hand-off link of one (prefill, decode) pair: ``const_s + per_token_s * tokens``."""

    const_s: float
    per_token_s: float


def build_requests(specs: Sequence[RequestSpec], arrivals: Sequence[float]) -> list[SimRequest]:
    """Fresh :class:`SimRequest` objects, one per (spec, arrival time in seconds)."""
    return [
        SimRequest(i, t, s.total_prompt_tokens, s.output_tokens, s.num_images + s.num_videos)
        for i, (s, t) in enumerate(zip(specs, arrivals, strict=True))
    ]


def _shortest(loads: Sequence[int]) -> int:
    best = 0
    for i in range(1, len(loads)):
        if loads[i] < loads[best]:
            best = i
    return best


def simulate_prefill(server: PrefillServer, requests: Sequence[SimRequest]) -> SimResult:
    """One prefill instance alone; sets ``first_token_s`` (TTFT)."""
    loop = EventLoop()
    inst = PrefillInstance(loop, server.timing, server.token_budget, server.max_batch, lambda r: None)
    loop.run([(r.arrival_s, partial(inst.submit, r)) for r in requests])
    return SimResult(requests)


def simulate_decode(server: DecodeServer, requests: Sequence[SimRequest]) -> SimResult:
    """One decode instance alone, KV arriving at the request's arrival time (its first
    token out at that instant); sets ``finish_s`` (TPOT)."""
    loop = EventLoop()
    inst = DecodeInstance(loop, server.timing, server.kv_capacity, server.max_batch)
    for r in requests:
        r.first_token_s = r.arrival_s
    loop.run([(r.arrival_s, partial(inst.submit, r)) for r in requests])
    return SimResult(requests)


def simulate_colocated(
    prefill: PrefillTiming,
    server: DecodeServer,
    token_budget: int,
    requests: Sequence[SimRequest],
    replicas: int = 1,
    mixed: MixedSteps | None = None,
) -> SimResult:
    """``replicas`` identical colocated instances (both phases each) behind a
    shortest-queue dispatcher; sets TTFT and TPOT. ``mixed``: their mixed steps
    (:class:`~mm_serve.planner.colocated_instance.ColocatedInstance`; None: prefill steps apart)."""
    loop = EventLoop()
    insts = [ColocatedInstance(loop, prefill, server.timing, server.kv_capacity, token_budget,
                               server.max_batch, mixed) for _ in range(replicas)]

    def arrive(req: SimRequest) -> None:
        insts[_shortest([inst.load for inst in insts])].submit(req)

    loop.run([(r.arrival_s, partial(arrive, r)) for r in requests])
    return SimResult(requests)


def simulate_disaggregated(
    prefills: Sequence[PrefillServer],
    decodes: Sequence[DecodeServer],
    handoff: Sequence[Sequence[Handoff]],
    requests: Sequence[SimRequest],
    shared: tuple[int, int] | None = None,
) -> SimResult:
    """A full disaggregated system; ``handoff[p][d]`` is the link from prefill ``p``
    to decode ``d``. Sets TTFT (at prefill) and TPOT (hand-off + decode). ``shared``
    ``(p, d)``: prefill ``p`` shares its core with decode ``d``, whose timing is then a
    :class:`~mm_serve.planner.shared_core.PacedDecodeTiming`; each batch of ``p`` is slowed by
    :func:`~mm_serve.planner.shared_core.prefill_slowdown` of ``d``'s running batch at its start."""
    loop = EventLoop()
    dec = [DecodeInstance(loop, s.timing, s.kv_capacity, s.max_batch) for s in decodes]
    slowdowns: list[Callable[[], float] | None] = [None] * len(prefills)
    if shared is not None:
        p_shared, d_shared = shared
        paced = decodes[d_shared].timing
        if not isinstance(paced, PacedDecodeTiming):
            raise ValueError("simulate_disaggregated: a shared core's decode timing must be a PacedDecodeTiming")
        running = dec[d_shared].running
        slowdowns[p_shared] = lambda: prefill_slowdown(paced, len(running), running.context)
    in_transit = [0] * len(dec)
    link_free = [[0.0] * len(dec) for _ in prefills]

    def land(d: int, req: SimRequest) -> None:
        in_transit[d] -= 1
        dec[d].submit(req)

    def prefilled(p: int, req: SimRequest) -> None:
        d = _shortest([inst.load + in_transit[i] for i, inst in enumerate(dec)])
        link = handoff[p][d]
        start = max(loop.now, link_free[p][d])
        link_free[p][d] = start + link.const_s + link.per_token_s * req.prompt_tokens
        in_transit[d] += 1
        loop.at(link_free[p][d], partial(land, d, req))

    pre = [PrefillInstance(loop, s.timing, s.token_budget, s.max_batch, partial(prefilled, i), slowdowns[i])
           for i, s in enumerate(prefills)]

    def arrive(req: SimRequest) -> None:
        pre[_shortest([inst.load for inst in pre])].submit(req)

    loop.run([(r.arrival_s, partial(arrive, r)) for r in requests])
    return SimResult(requests)
