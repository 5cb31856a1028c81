"""Candidate parallel configs per phase, their goodputs, and the unit mix.

DistServe Algorithm 1 (arXiv:2401.09670, §4.1): for every intra-op (TP) degree
within a node and inter-op (PP) degree within the cluster whose weights fit, find
the config's max rate by simulation and keep the one with the best goodput per GPU,
separately for prefill and decode; then size the numbers of prefill and decode
instances so that their rates match. Candidates are simulated in decreasing order of
an analytic per-GPU throughput bound, and the scan stops once the bound falls below
the best goodput found (the bound is padded by 25 % so that it exceeds the
simulated goodput; the pruning is a heuristic, not a proof).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from mm_serve.planner.evaluator import GoodputEvaluator
from mm_serve.planner.latency_model import ParallelConfig
from mm_serve.planner.placement import Unit

Stage = Literal["prefill", "decode", "colocated"]
MAX_INSTANCES_PER_ROLE = 16  # largest n or m tried for a unit


@dataclass(frozen=True)
class PhaseCandidate:
    """One parallel config and its simulated goodput (requests/s per instance)."""

    par: ParallelConfig
    goodput: float
    cross_node: bool = False

    @property
    def gpus(self) -> int:
        return self.par.gpus

    @property
    def per_gpu(self) -> float:
        """Goodput per GPU, requests/s/GPU."""
        return self.goodput / self.par.gpus


class Ranked(Protocol):
    """Anything ranked by goodput per GPU (ties: fewer GPUs)."""

    @property
    def gpus(self) -> int: ...

    @property
    def per_gpu(self) -> float: ...


R = TypeVar("R", bound=Ranked)


def near_best(items: Iterable[R], tolerance: float, limit: int) -> list[R]:
    """The items whose ``per_gpu`` is within ``tolerance`` (relative) of the best, best
    first (ties: fewer GPUs), ``limit`` at most; empty for no items."""
    ranked = sorted(items, key=lambda c: (-c.per_gpu, c.gpus))
    if not ranked:
        return []
    top = ranked[0].per_gpu
    return [c for c in ranked if c.per_gpu >= (1 - tolerance) * top][:limit]


def tp_degrees(num_heads: int, gpus_per_node: int) -> list[int]:
    """Powers of two up to a node's GPU count that divide the attention heads."""
    out, tp = [], 1
    while tp <= gpus_per_node:
        if num_heads % tp == 0:
            out.append(tp)
        tp *= 2
    return out


def fits(ev: GoodputEvaluator, par: ParallelConfig, stage: Stage) -> bool:
    """Whether the weights fit and leave KV room for the workload's largest request
    (its prompt for prefill, prompt + answer for decode and colocated)."""
    mem = ev.memory(par, vision=stage != "decode")
    need = ev.max_prompt if stage == "prefill" else ev.max_context
    return mem.kv_capacity_tokens >= need


def enumerate_configs(
    ev: GoodputEvaluator, stage: Stage, max_pp: int, max_gpus: int
) -> list[ParallelConfig]:
    """Configs with TP within a node, ``pp <= max_pp`` (and the layer count) and at
    most ``max_gpus`` GPUs, whose memory fits (see :func:`fits`)."""
    spec = ev.spec
    out = []
    for tp in tp_degrees(spec.shape.num_heads, spec.gpus_per_node):
        for pp in range(1, min(max_pp, spec.shape.num_layers) + 1):
            par = ParallelConfig(tp, pp)
            if par.gpus <= max_gpus and fits(ev, par, stage):
                out.append(par)
    return out


def _funcs(
    ev: GoodputEvaluator, stage: Stage
) -> tuple[Callable[[ParallelConfig, bool], float], Callable[[ParallelConfig, bool], float]]:
    if stage == "prefill":
        return ev.prefill_goodput, ev.prefill_bound
    if stage == "decode":
        return ev.decode_goodput, ev.decode_bound

    def colocated_bound(par: ParallelConfig, cross: bool) -> float:
        return 1.0 / (1.0 / ev.prefill_bound(par, cross) + 1.0 / ev.decode_bound(par, cross, True))

    return ev.colocated_goodput, colocated_bound


def best_config(
    ev: GoodputEvaluator,
    stage: Stage,
    configs: Iterable[ParallelConfig],
    cross_node: Callable[[ParallelConfig], bool],
) -> PhaseCandidate | None:
    """The config with the highest simulated goodput per GPU (None if all are 0)."""
    best = near_best_configs(ev, stage, configs, cross_node, tolerance=0.0, limit=1)
    return best[0] if best else None


def near_best_configs(
    ev: GoodputEvaluator,
    stage: Stage,
    configs: Iterable[ParallelConfig],
    cross_node: Callable[[ParallelConfig], bool],
    tolerance: float,
    limit: int,
) -> list[PhaseCandidate]:
    """Configs whose simulated goodput per GPU is within ``tolerance`` (relative) of
    the best, best first, ``limit`` at most; empty if every goodput is 0.

    Configs are simulated in decreasing order of their analytic bound per GPU, and
    the scan stops once the bound falls below ``(1 - tolerance)`` times the best.
    """
    goodput, bound = _funcs(ev, stage)
    ranked = sorted(configs, key=lambda p: -bound(p, cross_node(p)) / p.gpus)
    found: list[PhaseCandidate] = []
    top = 0.0  # best goodput per GPU so far
    for par in ranked:
        cross = cross_node(par)
        if found and bound(par, cross) / par.gpus <= (1 - tolerance) * top:
            break
        cand = PhaseCandidate(par, goodput(par, cross), cross)
        if cand.goodput > 0:
            found.append(cand)
            top = max(top, cand.per_gpu)
    return near_best(found, tolerance, limit)


def frontier(
    ev: GoodputEvaluator,
    stage: Stage,
    configs: Iterable[ParallelConfig],
    cross_node: Callable[[ParallelConfig], bool],
) -> list[PhaseCandidate]:
    """The best config of each instance size (GPU count) that is not dominated by a
    smaller size with at least its goodput per GPU; ascending by size.

    Mixing prefill and decode instances in a bounded cluster may prefer a smaller
    instance with a lower goodput per GPU (DistServe's replication step), so the
    search keeps one candidate per size instead of the single best.
    """
    _, bound = _funcs(ev, stage)
    by_size: dict[int, list[ParallelConfig]] = {}
    for par in configs:
        by_size.setdefault(par.gpus, []).append(par)
    out: list[PhaseCandidate] = []
    for size in sorted(by_size):
        group = by_size[size]
        best_small = max((c.per_gpu for c in out), default=0.0)
        if max(bound(p, cross_node(p)) / size for p in group) <= best_small:
            continue
        cand = best_config(ev, stage, group, cross_node)
        if cand is not None and cand.per_gpu > best_small:
            out.append(cand)
    return out


def phase_candidate(ev: GoodputEvaluator, stage: Stage, par: ParallelConfig, cross: bool) -> PhaseCandidate:
    """Simulated goodput of one given config (memoised by the evaluator)."""
    return PhaseCandidate(par, _funcs(ev, stage)[0](par, cross), cross)


def choose_mix(
    prefill: PhaseCandidate, decode: PhaseCandidate, feasible: Callable[[Unit], bool]
) -> tuple[Unit, float] | None:
    """Instance counts ``(n, m)`` maximising ``min(n Gp, m Gd) / GPUs`` among units
    ``feasible`` accepts (ties: fewer GPUs); returns the unit and its estimated rate
    (requests/s), or None if no unit is feasible."""
    ranked = ranked_mixes(prefill, decode, feasible, limit=1)
    return ranked[0] if ranked else None


def ranked_mixes(
    prefill: PhaseCandidate, decode: PhaseCandidate, feasible: Callable[[Unit], bool], limit: int
) -> list[tuple[Unit, float]]:
    """The ``limit`` best feasible ``(unit, estimated rate)`` of the pair, best
    ``min(n Gp, m Gd) / GPUs`` first (ties: fewer GPUs)."""
    scored = []
    for n in range(1, MAX_INSTANCES_PER_ROLE + 1):
        for m in range(1, MAX_INSTANCES_PER_ROLE + 1):
            unit = Unit(prefill.par, decode.par, n, m)
            rate = min(n * prefill.goodput, m * decode.goodput)
            scored.append(((rate / unit.gpus, -unit.gpus), unit, rate))
    scored.sort(key=lambda x: x[0], reverse=True)
    out: list[tuple[Unit, float]] = []
    for _, unit, rate in scored:
        if len(out) == limit:
            break
        if feasible(unit):
            out.append((unit, rate))
    return out
