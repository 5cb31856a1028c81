"""Roofline latency model: TP all-reduce, PP stages and bubbles, KV hand-off, memory."""

from __future__ import annotations

import math
from typing import Any

import pytest

from mm_serve.planner.fit import get_hardware
from mm_serve.planner.hardware import GIB, Hardware, PhaseCoefficients
from mm_serve.planner.latency_model import LatencyModel, ParallelConfig
from mm_serve.planner.memory import memory_plan
from mm_serve.planner.model_shape import ModelShape, shape_from_config
from mm_serve.planner.work import decode_work, encode_work, prefill_work

Configs = dict[str, dict[str, Any]]

HW = Hardware(
    name="round", memory_bytes=80 * GIB,
    prefill=PhaseCoefficients(1e-14, 1e-12, 1e-3),
    decode=PhaseCoefficients(2e-14, 1e-12, 2e-3),
    encode=PhaseCoefficients(3e-14, 1e-12, 5e-4),
    intra_node_bandwidth=1e11, inter_node_bandwidth=1e10, collective_latency_s=1e-5,
)


@pytest.fixture
def opt(configs: Configs) -> ModelShape:
    return shape_from_config(configs["opt-13b"])


def test_prefill_single_gpu_is_the_roofline_sum(opt: ModelShape) -> None:
    timing = LatencyModel(opt, HW).prefill_timing(ParallelConfig())
    lengths = [300, 700]
    w = prefill_work(opt, 1000, 300**2 + 700**2, 2, opt.num_layers)
    expect = w.flops * 1e-14 + w.bytes * 1e-12 + 1e-3
    assert timing.latency(1000, 300**2 + 700**2, len(lengths), 0) == pytest.approx(expect, rel=1e-9)
    assert timing.stage_time(1000, 580_000, 2, 0) == pytest.approx(expect, rel=1e-9)
    # 2 * params FLOPs per token dominates: ~2 * 12.6e9 * 1000 FLOPs at 1e-14 s/FLOP
    assert 0.25 < expect < 0.3


def test_tensor_parallel_divides_work_and_adds_allreduce(opt: ModelShape) -> None:
    model = LatencyModel(opt, HW)
    one = model.prefill_timing(ParallelConfig(1, 1)).latency(512, 512**2, 1, 0)
    two = model.prefill_timing(ParallelConfig(2, 1)).latency(512, 512**2, 1, 0)
    allreduce = 2 * 40 * (1e-5 + 2 * (1 / 2) * 512 * 5120 * 2 / 1e11)
    assert two == pytest.approx((one - 1e-3) / 2 + 1e-3 + allreduce, rel=1e-9)


def test_pipeline_stage_interval_latency_and_bubble(opt: ModelShape) -> None:
    model = LatencyModel(opt, HW)
    pp3 = model.prefill_timing(ParallelConfig(1, 3))
    stage = prefill_work(opt, 512, 512**2, 1, math.ceil(40 / 3))  # 14 layers + LM head
    stage_t = stage.flops * 1e-14 + stage.bytes * 1e-12 + 1e-3
    assert pp3.stage_time(512, 512**2, 1, 0) == pytest.approx(stage_t, rel=1e-9)
    hop = 1e-5 + 512 * 5120 * 2 / 1e11
    assert pp3.latency(512, 512**2, 1, 0) == pytest.approx(3 * stage_t + 2 * hop, rel=1e-9)
    single = model.prefill_timing(ParallelConfig()).latency(512, 512**2, 1, 0)
    assert pp3.latency(512, 512**2, 1, 0) > single  # 42 > 40 layer-times: the bubble
    assert pp3.stage_time(512, 512**2, 1, 0) < single / 2.5


def test_decode_step_and_micro_batches(opt: ModelShape) -> None:
    model = LatencyModel(opt, HW)
    w = decode_work(opt, 32, 32 * 600, 40)
    assert model.decode_timing(ParallelConfig()).step_time(32, 32 * 600) == pytest.approx(
        w.flops * 2e-14 + w.bytes * 1e-12 + 2e-3, rel=1e-9)
    pp2 = model.decode_timing(ParallelConfig(1, 2))
    s0 = pp2.stage_const
    work32 = pp2.stage_per_seq * 32 + pp2.stage_per_context * 32 * 600
    hop = pp2.hop_const + pp2.hop_per_seq * 16
    assert pp2.step_time(32, 32 * 600) == pytest.approx(2 * s0 + work32 + hop, rel=1e-9)
    # one sequence cannot be split: it passes both stages alone
    work1 = pp2.stage_per_seq + pp2.stage_per_context * 600
    assert pp2.step_time(1, 600) == pytest.approx(2 * (s0 + work1) + pp2.hop_const + pp2.hop_per_seq,
                                                 rel=1e-9)


def test_encode_only_when_images(configs: Configs) -> None:
    shape = shape_from_config(configs["llava-hf"])
    timing = LatencyModel(shape, HW).prefill_timing(ParallelConfig())
    text_only = timing.stage_time(600, 360_000, 1, 0)
    w0, w2 = encode_work(shape, 0), encode_work(shape, 2)
    enc2 = (w2.flops - w0.flops) * 3e-14 + w2.bytes * 1e-12 + 5e-4
    assert timing.stage_time(600, 360_000, 1, 2) - text_only == pytest.approx(enc2, rel=1e-9)
    # ViT-L/14-336 up to layer 23: ~2 * 0.3e9 params * 577 positions per image
    assert 3e11 < (w2.flops - w0.flops) / 2 < 5e11


def test_kv_handoff_time(opt: ModelShape) -> None:
    model = LatencyModel(opt, HW)
    tokens = 1000
    assert model.kv_transfer_time(tokens, 2, cross_node=False) == pytest.approx(
        1e-5 + tokens * 819_200 / (1e11 * 2))
    assert model.kv_transfer_time(tokens, 1, cross_node=True) == pytest.approx(
        1e-5 + tokens * 819_200 / 1e10)


def test_builtin_profiles_scale_with_bandwidth(opt: ModelShape) -> None:
    a100, h200 = get_hardware("a100-80gb"), get_hardware("H200-141GB")
    step_a = LatencyModel(opt, a100).decode_timing(ParallelConfig()).step_time(1, 500)
    step_h = LatencyModel(opt, h200).decode_timing(ParallelConfig()).step_time(1, 500)
    overhead = a100.decode.overhead_s
    # a batch-1 decode step streams the weights: time ratio ~ HBM ratio 4.8 / 2.039
    assert (step_a - overhead) / (step_h - overhead) == pytest.approx(4.8 / 2.039, rel=0.05)
    # OPT-13B at batch 1 on A100: ~26 GB of weights at 70 % of 2.039 TB/s + 6 ms
    assert 0.02 < step_a < 0.03
    assert h200.memory_bytes == 141e9


def test_memory_plan_kv_capacity(opt: ModelShape) -> None:
    hw = get_hardware("a100-80gb")
    one = memory_plan(opt, hw, ParallelConfig(1, 1), vision=False)
    usable = 0.9 * 80 * GIB - 2 * GIB
    assert one.weight_bytes_per_gpu == opt.params * 2
    assert one.kv_capacity_tokens == int((usable - opt.params * 2) // 819_200)
    two = memory_plan(opt, hw, ParallelConfig(2, 1), vision=False)
    assert two.kv_bytes_per_token_per_gpu == 819_200 / 2
    assert two.kv_capacity_tokens > 2.4 * one.kv_capacity_tokens  # weights no longer dominate
    tiny = Hardware(**{**HW.__dict__, "memory_bytes": 20 * GIB})
    assert not memory_plan(opt, tiny, ParallelConfig(1, 1), vision=False).fits


def test_a_tiled_image_costs_its_tower_passes(configs: Configs) -> None:
    """A LLaVA-NeXT image encodes as 5 tower passes of the same tower: its per-image encode time is
    that of 5 LLaVA-1.5 images' tower work, not one."""
    base = shape_from_config(configs["llava-hf"])
    tiled = shape_from_config({**configs["llava-hf"], "model_type": "llava_next",
                               "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672]]})
    assert tiled.vision is not None and tiled.vision.tiles_per_image == 5
    one = LatencyModel(base, HW).prefill_timing(ParallelConfig())
    five = LatencyModel(tiled, HW).prefill_timing(ParallelConfig())
    assert encode_work(tiled, 5).flops == encode_work(base, 5).flops
    assert five.per_image == pytest.approx(5 * one.per_image, rel=1e-9)


def test_a_per_sequence_stall_adds_its_seconds_for_every_sequence_of_a_step(opt: ModelShape) -> None:
    """The front end's CPU per streamed token, priced into an instance whose threads it stalls: a step of
    ``B`` sequences takes ``B * stall`` seconds more, whatever their context; a bad stall is refused."""
    timing = LatencyModel(opt, HW).decode_timing(ParallelConfig(2, 1))
    stalled = timing.with_stall_per_seq(0.0004)
    for batch, context in ((1, 600), (8, 8 * 600), (32, 32 * 1200)):
        assert stalled.step_time(batch, context) - timing.step_time(batch, context) == pytest.approx(
            0.0004 * batch, rel=1e-9)
    assert stalled.step_ends(0.0, 4, 4 * 100, 3)[-1] - timing.step_ends(0.0, 4, 4 * 100, 3)[-1] == pytest.approx(
        3 * 4 * 0.0004, rel=1e-9)
    assert timing.with_stall_per_seq(0.0) == timing
    for bad in (-1e-4, math.nan, math.inf):
        with pytest.raises(ValueError, match="per-sequence stall must be >= 0 seconds"):
            timing.with_stall_per_seq(bad)
    with pytest.raises(ValueError, match="without pipeline stages"):
        LatencyModel(opt, HW).decode_timing(ParallelConfig(1, 2)).with_stall_per_seq(0.0004)
