"""Placement search on OPT-13B / A100: DistServe's comparisons and the 4 x 8 search time."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mm_serve.ground.slo import SLO
from mm_serve.planner.candidates import PhaseCandidate
from mm_serve.planner.errors import PlannerError
from mm_serve.planner.evaluator import GoodputEvaluator
from mm_serve.planner.fit import get_hardware
from mm_serve.planner.latency_model import ParallelConfig
from mm_serve.planner.model_shape import shape_from_config
from mm_serve.planner.placement import Unit
from mm_serve.planner.plan_spec import PlanSpec
from mm_serve.planner.search import (
    SHORTLIST_SIZE,
    Mix,
    PlanResult,
    candidate_mixes,
    plan,
    shortlist,
    simulate_unit,
)
from mm_serve.workloads import make_workload

Configs = dict[str, dict[str, Any]]
CHATBOT_SLO = SLO(ttft_s=0.25, tpot_s=0.1)  # DistServe Table 1, chatbot, OPT-13B


def opt13b_spec(config: dict[str, Any], **kw: Any) -> PlanSpec:
    shape = shape_from_config(config, name="opt-13b")
    workload = kw.pop("workload", make_workload("chatbot", max_context=shape.max_context))
    return PlanSpec(shape, get_hardware("a100-80gb"), workload, kw.pop("slo", CHATBOT_SLO), **kw)


@pytest.fixture(scope="module")
def cluster_plan(module_configs: dict[str, dict[str, Any]]) -> PlanResult:
    """OPT-13B, chatbot, A100, 4 nodes x 8 GPUs, high affinity (shared by tests)."""
    return plan(opt13b_spec(module_configs["opt-13b"], nodes=4, gpus_per_node=8))


def test_search_on_4_nodes_of_8_gpus_is_fast_and_fills_the_cluster(
    cluster_plan: PlanResult, record_property: Callable[[str, object], None]
) -> None:
    line = f"planner, 4x8 search: {cluster_plan.seconds:.1f} s, {cluster_plan.simulations} simulations"
    print(line)
    record_property("figure", line)
    # a hang guard, not the speed target (that is a figure the suite prints: docs/testing.md): 16 s alone on a
    # Zen 5 dev machine, 74 s inside the suite on a slower AVX2 one
    assert cluster_plan.seconds < 300
    gpus = [g for inst in cluster_plan.placement for g in inst.gpus]
    assert len(gpus) == len(set(gpus)) == cluster_plan.gpus_used <= 32
    assert cluster_plan.gpus_used == cluster_plan.units * cluster_plan.unit.gpus
    assert cluster_plan.gpus_used > 32 - cluster_plan.unit.gpus  # no room for another unit
    for inst in cluster_plan.placement:
        assert len(inst.gpus) == inst.par.tp * inst.par.pp
        if inst.par.gpus <= 8:
            assert len(inst.nodes) == 1
    roles = [i.role for i in cluster_plan.placement]
    assert roles.count("prefill") == cluster_plan.units * cluster_plan.unit.num_prefill
    assert roles.count("decode") == cluster_plan.units * cluster_plan.unit.num_decode
    # the whole-unit simulation lands near the phase-by-phase estimate
    assert 0.7 < cluster_plan.unit_goodput / cluster_plan.estimated_unit_goodput < 1.3


def test_opt13b_chatbot_disaggregated_beats_best_colocated(
    cluster_plan: PlanResult, record_property: Callable[[str, object], None]
) -> None:
    """Issue #8: DistServe's chatbot setting (OPT-13B, ShareGPT-like chat, TTFT 0.25 s /
    TPOT 0.1 s, A100) on 4 x 8 GPUs; the colocated side is its best config pooled on
    as many GPUs as the disaggregated unit."""
    ratio = cluster_plan.ratio
    line = (f"planner, OPT-13B chatbot on 4x8 A100: disaggregated {cluster_plan.per_gpu_goodput:.3f} "
            f"vs colocated {cluster_plan.colocated_per_gpu_goodput:.3f} req/s/GPU, ratio {ratio:.2f}x")
    print(line)
    record_property("figure", line)
    assert ratio > 1.0


def test_chosen_unit_is_the_best_simulated_of_the_shortlist(cluster_plan: PlanResult) -> None:
    """The phase estimate min(n Gp, m Gd) ranks the candidate units; the reported unit
    must be the best of the near-tied ones once each is simulated whole, so it is at
    least as good as the estimate's favourite (which, here, it is not: pooling
    several prefill instances beats one large one under both SLOs at once)."""
    ev = GoodputEvaluator(cluster_plan.spec)
    listed = shortlist(candidate_mixes(ev))
    assert [m.unit for m in listed] == [u for u, _ in cluster_plan.shortlisted]  # the plan's own, in order
    per_gpu = [g / u.gpus for u, g in cluster_plan.shortlisted]
    print("shortlist:", [(f"{m.unit.num_prefill}x{m.unit.prefill}+{m.unit.num_decode}x{m.unit.decode}",
                          round(m.per_gpu, 3), round(g, 3)) for m, g in zip(listed, per_gpu, strict=True)])
    assert 2 <= len(listed) <= SHORTLIST_SIZE
    assert cluster_plan.unit in [m.unit for m in listed]
    assert cluster_plan.per_gpu_goodput == pytest.approx(max(per_gpu))
    assert cluster_plan.per_gpu_goodput > per_gpu[0] * 1.05  # beats the estimate's pick
    # the recorded figures are the simulation's (deterministic): re-simulate the estimate's favourite
    # and the chosen unit (the other shortlisted ones only cost time)
    chosen = next(m for m in listed if m.unit == cluster_plan.unit)
    for mix in (listed[0], chosen):  # two different units (the chosen one beats the favourite by 5 %)
        assert simulate_unit(ev, mix.unit, mix.estimate) == pytest.approx(dict(cluster_plan.shortlisted)[mix.unit])
    # the colocated side is pooled on about the unit's GPU count
    col_gpus = cluster_plan.colocated_unit_instances * cluster_plan.colocated.par.gpus
    assert abs(col_gpus - cluster_plan.unit.gpus) <= cluster_plan.colocated.par.gpus / 2


def _mix(n: int, m: int, estimate: float) -> Mix:
    one, two = ParallelConfig(1, 1), ParallelConfig(2, 1)
    return Mix(Unit(one, two, n, m), estimate, PhaseCandidate(one, 1.0), PhaseCandidate(two, 1.0))


def test_shortlist_keeps_the_near_ties_best_first() -> None:
    mixes = [_mix(1, 1, 3.0), _mix(2, 2, 6.6), _mix(1, 2, 4.0), _mix(2, 1, 3.0), _mix(4, 4, 12.0)]
    # TP1 prefill + TP2 decode: 3, 6, 5, 4, 12 GPUs, so per GPU 1.0, 1.1, 0.8, 0.75, 1.0
    got = [(m.unit.num_prefill, m.unit.num_decode) for m in shortlist(mixes)]
    assert got == [(2, 2), (1, 1), (4, 4)]  # within 10 % of 1.1; ties: fewer GPUs first
    many = [_mix(1, 1, 3.0 - i * 0.01) for i in range(10)]
    assert len(shortlist(many)) == SHORTLIST_SIZE


@pytest.fixture
def figure1_workload(tmp_path: Path) -> Any:
    path = tmp_path / "fig1.jsonl"
    path.write_text("\n".join(json.dumps({"prompt_len": 512, "output_len": 64}) for _ in range(4)))
    return make_workload(str(path))


def test_figure1_single_gpu_numbers(
    figure1_workload: Any, configs: Configs, record_property: Callable[[str, object], None]
) -> None:
    """DistServe Figure 1 (OPT-13B, one A100, 512 in / 64 out, P90 TTFT 0.4 s, P90 TPOT
    0.04 s): prefill-only 5.6, decode-only 10, colocated 1.6 req/s measured; 2 prefill
    GPUs + 1 decode GPU give 10 req/s on 3 GPUs, 2.1x colocated per GPU."""
    ev = GoodputEvaluator(opt13b_spec(configs["opt-13b"], workload=figure1_workload,
                                      slo=SLO(0.4, 0.04)))
    one = ParallelConfig(1, 1)
    pre, dec, col = ev.prefill_goodput(one, False), ev.decode_goodput(one, False), ev.colocated_goodput(one, False)
    per_gpu = min(2 * pre, dec) / 3
    line = (f"planner, DistServe Figure 1: prefill-only {pre:.2f}, decode-only {dec:.2f}, colocated "
            f"{col:.2f} req/s; 2P1D {per_gpu:.2f} req/s/GPU = {per_gpu / col:.2f}x colocated")
    print(line)
    record_property("figure", line)
    assert pre == pytest.approx(5.6, rel=0.2)
    assert dec == pytest.approx(10.0, rel=0.2)
    assert col == pytest.approx(1.6, rel=0.2)
    assert per_gpu / col == pytest.approx(2.1, rel=0.2)


def test_figure1_workload_plan_beats_best_colocated(figure1_workload: Any, configs: Configs) -> None:
    result = plan(opt13b_spec(configs["opt-13b"], workload=figure1_workload, slo=SLO(0.4, 0.04),
                              gpus_per_node=4))
    print(f"Figure 1 workload on 1x4 A100: {result.per_gpu_goodput:.2f} vs colocated "
          f"{result.colocated_per_gpu_goodput:.2f} req/s/GPU, ratio {result.ratio:.2f}x")
    assert result.ratio > 1.1
    assert result.unit.gpus <= 4


def test_low_affinity_keeps_each_prefill_stage_with_its_decode_partner(configs: Configs) -> None:
    """Tight SLOs (TTFT 0.1 s, TPOT 30 ms): a unit of larger instances (TP 2 prefill, TP 4 decode), and
    short probes (the simulated runs follow the SLO slack): 5 s, not the chatbot SLOs' 15 s."""
    result = plan(opt13b_spec(configs["opt-13b"], nodes=2, gpus_per_node=8, affinity="low", slo=SLO(0.1, 0.03)))
    pp = result.unit.prefill.pp
    assert result.unit.decode.pp == pp
    assert result.units == 2 // pp
    per_unit = result.unit.num_prefill + result.unit.num_decode
    for u in range(result.units):
        unit = result.placement[u * per_unit:(u + 1) * per_unit]
        nodes = {inst.nodes for inst in unit}
        assert len(nodes) == 1  # every instance of the unit spans the same nodes
        assert {i.role for i in unit} == {"prefill", "decode"}
        assert sum(i.par.tp for i in unit) <= 8  # one node's GPUs per stage


def test_config_that_misses_the_slo_even_when_idle_is_not_simulated(configs: Configs) -> None:
    """OPT-13B's batch-1 decode step on one A100 is ~24 ms: a 10 ms TPOT SLO can't be
    met at any rate, which the evaluator knows without simulating (low-rate probes are
    the slowest); at 0.1 s every request meets it when alone, so it simulates."""
    tight = GoodputEvaluator(opt13b_spec(configs["opt-13b"], slo=SLO(0.25, 0.01)))
    one = ParallelConfig(1, 1)
    n = tight.spec.num_requests
    assert tight.alone_attainment(n, None, tight.decode_server(one, False).timing) == 0.0
    assert tight.decode_goodput(one, False) == 0.0
    assert tight.colocated_goodput(one, False) == 0.0
    assert tight.simulations == 0
    # TTFT alone: prompts of the chatbot workload prefill in well under 0.25 s
    prefill = tight.prefill_server(one, False).timing
    assert tight.alone_attainment(n, prefill, None) == 1.0
    loose = GoodputEvaluator(opt13b_spec(configs["opt-13b"]))
    assert loose.alone_attainment(n, None, loose.decode_server(one, False).timing) == 1.0
    assert loose.decode_goodput(one, False) > 0 and loose.simulations > 0


def test_unit_that_misses_both_slos_together_is_an_error(tmp_path: Path, configs: Configs) -> None:
    """Each phase meets its SLO alone, but the cross-node KV hand-off of 1000-token
    prompts (~0.8 GB over one 25 GB/s NIC) pushes the short answers past a 30 ms TPOT:
    no unit is a placement, so the planner says so instead of printing 0 req/s."""
    path = tmp_path / "handoff.jsonl"
    rows = [{"prompt_len": 1000, "output_len": 2}] * 5 + [{"prompt_len": 100, "output_len": 100}] * 5
    path.write_text("\n".join(json.dumps(r) for r in rows))
    spec = opt13b_spec(configs["opt-13b"], workload=make_workload(str(path)), slo=SLO(1.0, 0.03),
                       nodes=2, gpus_per_node=1)
    with pytest.raises(PlannerError, match="each phase meets its own SLO alone"):
        plan(spec)


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_min_step_time_bounds_every_batch(pp: int, configs: Configs) -> None:
    """The idle check's TPOT bound: no batch makes a sequence's step shorter."""
    ev = GoodputEvaluator(opt13b_spec(configs["opt-13b"]))
    timing = ev.model.decode_timing(ParallelConfig(1, pp))
    for own in (10, 500, 2000):
        bound = timing.min_step_time(own)
        if pp == 1:
            assert bound == pytest.approx(timing.step_time(1, own))
        for batch, others in ((1, 0), (2, 10), (4, 30), (64, 64 * 300)):
            assert bound <= timing.step_time(batch, own + others) + 1e-12
