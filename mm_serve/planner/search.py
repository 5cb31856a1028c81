"""Placement search: the disaggregated unit with the best per-GPU goodput, replicated.

* High node-affinity, DistServe Algorithm 1 (arXiv:2401.09670, §4.1): best prefill
  config and best decode config chosen independently (TP within a node, PP up to
  the cluster), mixed in the ratio that matches their rates.
* Low node-affinity, Algorithm 2 (§4.2): for each pipeline degree ``pp`` up to the
  node count, every pair of (prefill TP, decode TP) whose stages share one node;
  the unit spans ``pp`` nodes, stage ``k`` of all its instances on node ``k``.

The phase estimate ``min(n Gp, m Gd)`` ignores what a whole unit adds or loses
(dispatch across several instances pools their queues, the hand-off costs time,
both SLOs must hold at once), and several mixes often tie on it. So the units whose
estimated goodput per GPU is within ``SHORTLIST_TOLERANCE`` of the best (at most
``SHORTLIST_SIZE`` of them) are each simulated as a whole (dispatch, KV hand-off
over the links its placement implies, both SLOs at once), and the one with the best
simulated goodput per GPU is chosen and reported. The colocated comparison gets the
same treatment: the configs within ``SHORTLIST_TOLERANCE`` of the best single-instance
goodput per GPU are each simulated as a pool of replicas holding about as many GPUs
as the chosen unit, behind the same shortest-queue dispatcher (so that both sides get
the same pooling gain), and the best pool is reported.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from mm_serve.planner.candidates import (
    PhaseCandidate,
    enumerate_configs,
    fits,
    frontier,
    near_best,
    near_best_configs,
    phase_candidate,
    ranked_mixes,
    tp_degrees,
)
from mm_serve.planner.errors import PlannerError
from mm_serve.planner.evaluator import GoodputEvaluator
from mm_serve.planner.latency_model import ParallelConfig
from mm_serve.planner.memory import usable_bytes
from mm_serve.planner.placement import (
    GpuPool,
    InstancePlacement,
    Unit,
    colocated_replicas,
    place_group,
    place_unit,
    replicate,
    unit_handoff_pairs,
)
from mm_serve.planner.plan_spec import PlanSpec

SHORTLIST_TOLERANCE = 0.25  # relative gap to the best estimate per GPU
SHORTLIST_SIZE = 6  # most units simulated whole
MIXES_PER_PAIR = 2  # best (n, m) mixes kept per (prefill, decode) config pair


@dataclass(frozen=True)
class Mix:
    """A candidate unit and its phase estimate ``min(n Gp, m Gd)`` (requests/s)."""

    unit: Unit
    estimate: float
    prefill: PhaseCandidate
    decode: PhaseCandidate

    @property
    def gpus(self) -> int:
        return self.unit.gpus

    @property
    def per_gpu(self) -> float:
        return self.estimate / self.unit.gpus


@dataclass(frozen=True)
class PlanResult:
    """The chosen placement and its goodputs (requests/s; per GPU: requests/s/GPU)."""

    spec: PlanSpec
    unit: Unit
    unit_goodput: float  # whole unit simulated, both SLOs
    estimated_unit_goodput: float  # min(n Gp, m Gd) from the phase searches
    prefill: PhaseCandidate
    decode: PhaseCandidate
    placement: tuple[InstancePlacement, ...]
    units: int
    colocated: PhaseCandidate | None  # config of the best colocated pool (goodput: one instance)
    colocated_unit_instances: int  # replicas simulated together for the comparison
    colocated_unit_goodput: float  # their goodput, both SLOs, requests/s
    colocated_placement: tuple[InstancePlacement, ...]
    simulations: int
    seconds: float
    # every shortlisted unit with its whole-unit simulated goodput (requests/s), in the
    # estimate's order (the estimate's favourite first); the chosen one is the best per GPU
    shortlisted: tuple[tuple[Unit, float], ...] = ()

    @property
    def per_gpu_goodput(self) -> float:
        return self.unit_goodput / self.unit.gpus

    @property
    def colocated_per_gpu_goodput(self) -> float:
        if self.colocated is None:
            return 0.0
        return self.colocated_unit_goodput / (self.colocated_unit_instances * self.colocated.par.gpus)

    @property
    def cluster_goodput(self) -> float:
        return self.unit_goodput * self.units

    @property
    def gpus_used(self) -> int:
        return self.unit.gpus * self.units

    @property
    def ratio(self) -> float:
        """Disaggregated over colocated per-GPU goodput (inf if colocated is 0)."""
        col = self.colocated_per_gpu_goodput
        return self.per_gpu_goodput / col if col > 0 else float("inf")


def _high_affinity(ev: GoodputEvaluator) -> list[Mix]:
    spec = ev.spec
    total, per_node = spec.total_gpus, spec.gpus_per_node
    if total < 2:
        raise PlannerError("a disaggregated placement needs at least 2 GPUs (one prefill, one decode)")

    def cross(par: ParallelConfig) -> bool:
        return par.gpus > per_node

    pre_configs = enumerate_configs(ev, "prefill", total, total - 1)
    dec_configs = enumerate_configs(ev, "decode", total, total - 1)
    if not pre_configs or not dec_configs:
        raise PlannerError(_no_fit_message(ev, total - 1))
    pres = frontier(ev, "prefill", pre_configs, cross)
    decs = frontier(ev, "decode", dec_configs, cross)
    if not pres:
        raise PlannerError(_no_phase_message(ev, "prefill", pre_configs, cross))
    if not decs:
        raise PlannerError(_no_phase_message(ev, "decode", dec_configs, cross))

    def feasible(unit: Unit) -> bool:
        return unit.gpus <= total and place_unit(unit, GpuPool(spec.nodes, per_node)) is not None

    mixes = _pair_mixes(pres, decs, feasible)
    if not mixes:
        raise PlannerError(
            f"no prefill and decode pair of {spec.shape.name} that meets the SLOs fits "
            f"{spec.nodes} x {per_node} GPUs: the prefill candidates take "
            f"{_sizes(pres)} GPUs, the decode candidates {_sizes(decs)} (use more GPUs)")
    return mixes


def _pair_mixes(
    pres: list[PhaseCandidate],
    decs: list[PhaseCandidate],
    feasible: Callable[[Unit], bool],
) -> list[Mix]:
    """The ``MIXES_PER_PAIR`` best mixes (n, m) of every (prefill, decode) pair."""
    return [Mix(unit, rate, pre, dec) for pre in pres for dec in decs
            for unit, rate in ranked_mixes(pre, dec, feasible, MIXES_PER_PAIR)]


def _low_affinity(ev: GoodputEvaluator) -> list[Mix]:
    spec = ev.spec
    per_node = spec.gpus_per_node
    mixes: list[Mix] = []
    tps = [t for t in tp_degrees(spec.shape.num_heads, per_node) if t < per_node]
    roles: tuple[Literal["prefill", "decode"], ...] = ("prefill", "decode")
    held: dict[str, list[ParallelConfig]] = {"prefill": [], "decode": []}
    found: dict[str, bool] = {"prefill": False, "decode": False}
    for pp in range(1, min(spec.nodes, spec.shape.num_layers) + 1):
        cands: dict[str, list[PhaseCandidate]] = {}
        for role in roles:
            pars = [ParallelConfig(t, pp) for t in tps if fits(ev, ParallelConfig(t, pp), role)]
            held[role] += pars
            cands[role] = [c for p in pars if (c := phase_candidate(ev, role, p, pp > 1)).goodput > 0]
            found[role] = found[role] or bool(cands[role])
        if cands["prefill"] and cands["decode"]:
            mixes += _pair_mixes(cands["prefill"], cands["decode"],
                                 lambda u: u.gpus // u.prefill.pp <= per_node)
    if mixes:
        return mixes
    if not held["prefill"] or not held["decode"]:
        if not enumerate_configs(ev, "decode", spec.nodes, spec.total_gpus):
            raise PlannerError(_no_fit_message(ev, spec.total_gpus))
        raise PlannerError(
            f"{spec.shape.name} fits only with a whole node ({per_node} GPU"
            f"{'' if per_node == 1 else 's'}) per pipeline stage; "
            "--affinity low puts a prefill and a decode stage on one node: try --affinity high")
    for role in roles:
        if not found[role]:
            raise PlannerError(_no_phase_message(ev, role, held[role], lambda p: p.pp > 1))
    raise PlannerError(
        f"no prefill and decode pair of {spec.shape.name} that meets the SLOs shares a node per "
        f"pipeline stage ({per_node} GPUs per node): try --affinity high")


def candidate_mixes(ev: GoodputEvaluator) -> list[Mix]:
    """Every (prefill, decode) pair's best mix under the spec's node affinity.

    Raises:
        PlannerError: no pair meets the SLOs in a unit that fits the cluster.
    """
    return _low_affinity(ev) if ev.spec.affinity == "low" else _high_affinity(ev)


def shortlist(mixes: list[Mix]) -> list[Mix]:
    """The mixes worth simulating whole: best estimate per GPU first, then every one
    within ``SHORTLIST_TOLERANCE`` of it, ``SHORTLIST_SIZE`` at most (ties: fewer GPUs)."""
    return near_best(mixes, SHORTLIST_TOLERANCE, SHORTLIST_SIZE)


def _no_fit_message(ev: GoodputEvaluator, max_gpus: int) -> str:
    """Why no config holds the model: its weights and the largest request's KV."""
    spec, shape = ev.spec, ev.spec.shape
    usable = usable_bytes(spec.hardware)
    gpus = f"{max_gpus} GPU" + ("" if max_gpus == 1 else "s")
    return (f"{shape.name} does not fit in one instance of at most {gpus} of "
            f"{spec.hardware.name} (a prefill and a decode instance share the "
            f"{spec.total_gpus}): {shape.weight_bytes / 2**30:.1f} GiB of weights plus the KV of a "
            f"{ev.max_context}-token request, {usable / 2**30:.1f} GiB usable per GPU "
            "(use more GPUs per node or nodes, or a smaller model)")


def _sizes(candidates: list[PhaseCandidate]) -> str:
    return ", ".join(str(g) for g in sorted({c.gpus for c in candidates}))


def _no_phase_message(
    ev: GoodputEvaluator,
    role: Literal["prefill", "decode"],
    configs: list[ParallelConfig],
    cross: Callable[[ParallelConfig], bool],
) -> str:
    """Why no config of ``role`` has a goodput: the SLO is out of reach even for an
    idle instance (see :meth:`GoodputEvaluator.alone_attainment`), or only under load."""
    spec = ev.spec
    if role == "prefill":
        slo = f"TTFT {spec.slo.ttft_s} s"
        shares = [(ev.alone_attainment(len(ev.specs), ev.model.prefill_timing(p, cross(p)), None), p)
                  for p in configs]
    else:
        slo = f"TPOT {spec.slo.tpot_s} s"
        shares = [(ev.alone_attainment(len(ev.specs), None, ev.decode_server(p, cross(p)).timing), p)
                  for p in configs]
    share, par = max(shares, key=lambda x: (x[0], -x[1].gpus))
    sizes = sorted({p.gpus for p in configs})
    span = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
    head = (f"no {role} configuration of {spec.shape.name} on {spec.hardware.name} meets {slo} "
            f"for {spec.attainment:.0%} of requests: of the {len(configs)} that hold the model "
            f"({span} GPU{'s' if sizes[-1] > 1 else ''}), ")
    if share >= spec.attainment:
        return head + (f"the best, TP{par.tp} PP{par.pp}, meets it for {share:.0%} idle but for too "
                       "few under any load the search tried")
    best = ("none meets it for any request" if share == 0
            else f"the best, TP{par.tp} PP{par.pp}, meets it for {share:.0%}")
    return head + (f"{best} even idle (one request at a time); relax the SLO, or allow larger "
                   "instances (more GPUs per node, or nodes for pipeline stages) if the model's "
                   "heads and layers leave room")


def _unit_instances(unit: Unit, spec: PlanSpec) -> list[InstancePlacement]:
    if spec.affinity == "low":
        return place_group(unit, 0, spec.gpus_per_node)
    placed = place_unit(unit, GpuPool(spec.nodes, spec.gpus_per_node))
    if placed is None:  # feasible() checked this
        raise PlannerError("unit does not fit the cluster")
    return placed


def simulate_unit(ev: GoodputEvaluator, unit: Unit, upper: float) -> float:
    """Goodput (requests/s) of one unit simulated whole, both SLOs."""
    instances = _unit_instances(unit, ev.spec)
    cross = unit_handoff_pairs(instances)
    pre = [i for i in instances if i.role == "prefill"]
    dec = [i for i in instances if i.role == "decode"]
    prefills = [ev.prefill_server(i.par, len(i.nodes) > 1) for i in pre]
    decodes = [ev.decode_server(i.par, len(i.nodes) > 1) for i in dec]
    handoff = [[ev.handoff(p.par, d.par, cross[a][b]) for b, d in enumerate(dec)]
               for a, p in enumerate(pre)]
    return ev.disaggregated_goodput(prefills, decodes, handoff, upper)


def best_colocated(ev: GoodputEvaluator, gpus: int) -> tuple[PhaseCandidate, int, float] | None:
    """The best colocated pool of about ``gpus`` GPUs: the configs within
    ``SHORTLIST_TOLERANCE`` of the best single-instance goodput per GPU (at most
    ``SHORTLIST_SIZE``), each simulated as ``round(gpus / its GPUs)`` replicas behind
    one dispatcher (as many as the cluster holds, at least one); returns the config,
    its replica count and their goodput (requests/s), or None if no config meets the
    SLOs."""
    spec = ev.spec
    configs = enumerate_configs(ev, "colocated", spec.total_gpus, spec.total_gpus)
    near = near_best_configs(ev, "colocated", configs, lambda p: p.gpus > spec.gpus_per_node,
                             SHORTLIST_TOLERANCE, SHORTLIST_SIZE)
    best: tuple[PhaseCandidate, int, float] | None = None
    for cand in near:
        room = len(colocated_replicas(cand.par, spec.nodes, spec.gpus_per_node))
        count = max(1, min(room, math.floor(gpus / cand.par.gpus + 0.5)))
        goodput = ev.colocated_goodput(cand.par, cand.cross_node, count)
        per_gpu = goodput / (count * cand.par.gpus)
        if best is None or per_gpu > best[2] / (best[1] * best[0].par.gpus):
            best = (cand, count, goodput)
    return best


def plan(spec: PlanSpec, evaluator: GoodputEvaluator | None = None, colocated_pool: bool = True) -> PlanResult:
    """Search the placement for ``spec`` (see the module docstring), with ``evaluator`` (one of
    ``spec``; a new one when None): its goodputs are memoized, so a caller that asks it for more
    afterwards reuses the search's simulations. ``colocated_pool`` False: no search for the best
    colocated pool to compare with (``colocated`` None in the result), for a caller that compares
    with a colocated placement of its own.

    Raises:
        PlannerError: no configuration fits in memory or meets the SLOs.
        ValueError: ``evaluator`` evaluates another spec.
    """
    start = time.perf_counter()
    if evaluator is not None and evaluator.spec is not spec:
        raise ValueError("plan(): the evaluator given evaluates another spec")
    ev = evaluator or GoodputEvaluator(spec)
    simulated = [(simulate_unit(ev, m.unit, m.estimate), m) for m in shortlist(candidate_mixes(ev))]
    goodput, chosen = max(simulated, key=lambda gm: (gm[0] / gm[1].unit.gpus, -gm[1].unit.gpus))
    if goodput <= 0:
        raise PlannerError(
            f"no disaggregated unit of {spec.shape.name} on {spec.hardware.name} meets both SLOs "
            f"(TTFT {spec.slo.ttft_s} s, TPOT {spec.slo.tpot_s} s) at {spec.attainment:.0%} "
            "attainment: each phase meets its own SLO alone, but with the KV hand-off between "
            "them too few requests meet both")
    unit, estimate, pre, dec = chosen.unit, chosen.estimate, chosen.prefill, chosen.decode
    placement, units = replicate(unit, spec.nodes, spec.gpus_per_node, spec.affinity)
    pool = best_colocated(ev, unit.gpus) if colocated_pool else None
    colocated, col_count, col_goodput = pool if pool else (None, 0, 0.0)
    col_placement = (colocated_replicas(colocated.par, spec.nodes, spec.gpus_per_node)
                     if colocated else [])
    return PlanResult(
        spec=spec, unit=unit, unit_goodput=goodput, estimated_unit_goodput=estimate,
        prefill=pre, decode=dec, placement=tuple(placement), units=units,
        colocated=colocated, colocated_unit_instances=col_count,
        colocated_unit_goodput=col_goodput, colocated_placement=tuple(col_placement),
        simulations=ev.simulations, seconds=time.perf_counter() - start,
        shortlisted=tuple((m.unit, g) for g, m in simulated),
    )
