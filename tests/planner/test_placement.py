"""GPU assignment, replication over the cluster, and the config YAML written for a plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from mm_serve.config import config_from_dict, load_config
from mm_serve.ground.slo import SLO
from mm_serve.planner.candidates import PhaseCandidate, choose_mix, tp_degrees
from mm_serve.planner.errors import PlannerError
from mm_serve.planner.fit import get_hardware
from mm_serve.planner.latency_model import ParallelConfig as P
from mm_serve.planner.model_shape import shape_from_config
from mm_serve.planner.placement import (
    GpuPool,
    Unit,
    colocated_replicas,
    place_group,
    replicate,
    unit_handoff_pairs,
)
from mm_serve.planner.plan_config import placement_dict, write_placement_config
from mm_serve.planner.plan_spec import PlanSpec
from mm_serve.planner.search import PlanResult
from mm_serve.workloads import make_workload

Configs = dict[str, dict[str, Any]]


def test_pool_keeps_small_instances_on_one_node() -> None:
    pool = GpuPool(nodes=2, gpus_per_node=4)
    assert pool.take(P(2, 1)) == (0, 1)
    assert pool.take(P(1, 3)) == (4, 5, 6)  # node 0 has only 2 left
    assert pool.take(P(2, 1)) == (2, 3)
    assert pool.take(P(2, 1)) is None  # node 1 has one GPU left
    assert pool.take(P(1, 1)) == (7,)


def test_pool_spreads_big_instances_stage_by_stage() -> None:
    pool = GpuPool(nodes=3, gpus_per_node=4)
    assert pool.take(P(4, 2)) == (0, 1, 2, 3, 4, 5, 6, 7)
    assert pool.take(P(4, 2)) is None
    assert pool.free == [[], [], [8, 9, 10, 11]]


def test_replicate_high_affinity_until_full() -> None:
    unit = Unit(P(1, 1), P(2, 1), 2, 1)  # 4 GPUs: the 2P1D of DistServe Figure 1, TP2 decode
    placement, units = replicate(unit, nodes=2, gpus_per_node=8, affinity="high")
    assert units == 4 and len(placement) == 12
    assert [i.role for i in placement[:3]] == ["prefill", "prefill", "decode"]
    assert [i.gpus for i in placement[:3]] == [(0,), (1,), (2, 3)]
    assert sorted(g for i in placement for g in i.gpus) == list(range(16))
    cross = unit_handoff_pairs(placement[:3])
    assert cross == [[False], [False]]


def test_low_affinity_group_puts_stage_k_of_everyone_on_node_k() -> None:
    unit = Unit(P(2, 2), P(4, 2), 1, 1)
    group = place_group(unit, first_node=2, gpus_per_node=8)
    assert group[0].gpus == (16, 17, 24, 25) and group[0].nodes == (2, 3)
    assert group[1].gpus == (18, 19, 20, 21, 26, 27, 28, 29) and group[1].nodes == (2, 3)
    assert unit_handoff_pairs(group) == [[False]]
    placement, units = replicate(unit, nodes=5, gpus_per_node=8, affinity="low")
    assert units == 2 and len(placement) == 4
    with pytest.raises(ValueError, match="needs 10 GPUs per node"):
        place_group(Unit(P(2, 1), P(4, 1), 3, 1), 0, 8)


def test_colocated_replicas_fill_the_cluster() -> None:
    assert len(colocated_replicas(P(2, 1), nodes=4, gpus_per_node=8)) == 16
    assert len(colocated_replicas(P(4, 3), nodes=4, gpus_per_node=8)) == 2


def test_mix_matches_phase_rates() -> None:
    pre, dec = PhaseCandidate(P(1, 1), 5.6), PhaseCandidate(P(1, 1), 10.0)
    unit, rate = choose_mix(pre, dec, lambda u: u.gpus <= 3) or (None, 0.0)
    assert unit == Unit(P(1, 1), P(1, 1), 2, 1) and rate == pytest.approx(10.0)  # Figure 1: 2P1D
    unit, rate = choose_mix(pre, dec, lambda u: u.gpus <= 8) or (None, 0.0)
    assert unit == Unit(P(1, 1), P(1, 1), 5, 3) and rate == pytest.approx(28.0)  # 3.5 > 3.33 /GPU
    assert choose_mix(pre, dec, lambda u: u.gpus <= 1) is None
    assert tp_degrees(40, 8) == [1, 2, 4, 8] and tp_degrees(12, 8) == [1, 2, 4]


def fake_result(config: dict[str, Any], unit: Unit, nodes: int) -> PlanResult:
    shape = shape_from_config(config, name="opt-13b")
    spec = PlanSpec(shape, get_hardware("a100-80gb"), make_workload("chatbot"), SLO(0.25, 0.1),
                    nodes=nodes, gpus_per_node=8)
    placement, units = replicate(unit, nodes, 8, "high")
    return PlanResult(
        spec=spec, unit=unit, unit_goodput=10.0, estimated_unit_goodput=11.0,
        prefill=PhaseCandidate(unit.prefill, 6.0), decode=PhaseCandidate(unit.decode, 11.0),
        placement=tuple(placement), units=units, colocated=PhaseCandidate(P(2, 1), 7.0),
        colocated_unit_instances=2, colocated_unit_goodput=14.0, colocated_placement=(),
        simulations=0, seconds=0.0,
    )


def test_written_config_loads_and_matches_the_placement(tmp_path: Path, configs: Configs) -> None:
    result = fake_result(configs["opt-13b"], Unit(P(1, 1), P(2, 1), 2, 1), nodes=2)
    path = tmp_path / "plan.yaml"
    cfg = write_placement_config(result, "/models/opt-13b", path)
    assert cfg == load_config(path)
    assert path.read_text().startswith("# Written by `mm-serve plan`")
    # 2.5 req/s/GPU disaggregated against 3.5 colocated: the file says which placement it is
    assert "# Colocated serving was predicted higher (3.500 req/s/GPU, 0.71x)" in path.read_text()
    c = cfg.compute
    assert (c.prefill_workers, c.decode_workers) == (8, 4)
    assert (c.prefill_tensor_parallel, c.decode_tensor_parallel) == (1, 2)
    assert c.prefill_gpus == [0, 1, 4, 5, 8, 9, 12, 13]
    assert c.decode_gpus == [2, 3, 6, 7, 10, 11, 14, 15]
    assert cfg.mode == "disaggregated" and cfg.dtype == "float16" and cfg.model == "/models/opt-13b"
    assert cfg.scheduler.decode_max_concurrent == 256 and cfg.scheduler.prefill_token_budget == 2048
    assert cfg.kv_cache.page_size == 16
    # a TP2 decode instance of OPT-13B on A100-80GB holds ~149k KV tokens
    assert 9000 < cfg.kv_cache.max_pages_per_gpu < 9600
    assert yaml.safe_load(path.read_text())["compute"]["decode_workers"] == 4



def test_a_cpu_placement_keeps_the_default_kv_pool(tmp_path: Path, configs: Configs) -> None:
    """``--device cpu``: no GPU ids and no per-GPU KV page count (every CPU worker's pool, prefill ones too,
    comes out of the host's memory: the planner's count for a GPU of the profile's memory, written for
    each of three workers, got a worker OOM-killed); the header says so."""
    result = fake_result(configs["opt-13b"], Unit(P(1, 1), P(1, 1), 1, 1), nodes=1)
    path = tmp_path / "plan.yaml"
    cfg = write_placement_config(result, "/models/opt-13b", path, device="cpu")
    assert cfg.compute.prefill_gpus == [] and cfg.compute.decode_gpus == []
    assert cfg.kv_cache.max_pages_per_gpu == config_from_dict({}).kv_cache.max_pages_per_gpu
    assert "kv_cache.max_pages_per_gpu keeps its default" in path.read_text()
    assert "Colocated serving was predicted higher" not in path.read_text()  # 5 req/s/GPU against 3.5


def test_config_limits_are_reported(configs: Configs) -> None:
    result = fake_result(configs["opt-13b"], Unit(P(1, 1), P(1, 1), 1, 1), nodes=40)
    with pytest.raises(PlannerError, match="exceed the config limit of 64"):
        placement_dict(result, "m")
