"""The placement `mm-serve serve` picks when the config pins none: the planner's choice on a 2-core profile,
the keys that pin a placement, the profile cache, and a real server that reports its choice in /health."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from mm_serve.cli.bench import served_placement_name
from mm_serve.config import config_from_dict, load_config
from mm_serve.ground.slo import SLO
from mm_serve.kernels import cpu_extension
from mm_serve.models.named_models import EMBEDDED_MODEL_DIR
from mm_serve.planner.auto_placement import (
    apply_placement,
    cached_profile,
    choose_placement,
    parallel_degrees,
    pinned_keys,
    profile_key,
)
from mm_serve.planner.evaluator import GoodputEvaluator
from mm_serve.planner.fit import get_hardware
from mm_serve.planner.latency_model import ParallelConfig
from mm_serve.planner.model_shape import load_model_shape
from mm_serve.planner.plan_spec import PlanSpec
from mm_serve.planner.simulator import simulate_decode, simulate_prefill
from mm_serve.workloads import make_workload
from tests.api.server_process import ServerProcess

# The benchmark Llama (8 layers, hidden 512) as bench-llama's config.json has it.
BENCH_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "intermediate_size": 1408,
    "num_attention_heads": 8, "num_hidden_layers": 8, "num_key_value_heads": 4, "head_dim": 64,
    "max_position_embeddings": 4096, "vocab_size": 2048, "tie_word_embeddings": False, "dtype": "float32",
}
# One torch thread on one core of a 2-core Xeon (mm-serve profile, 2026-12-05): seconds per pass.
PREFILL = [(32, 0.0224), (256, 0.163), (1024, 0.651)]
DECODE = [(1, 128, 0.00882), (1, 512, 0.0109), (8, 128, 0.0105), (8, 512, 0.0147), (32, 128, 0.0252),
          (32, 512, 0.0551)]
# Two torch threads on both cores of that kind of machine (mm-serve profile --parallel-threads 2,
# 2026-12-05): about 1.8x one thread, not 2x.
PREFILL_2 = [(32, 0.0154), (128, 0.0319), (512, 0.1166), (1024, 0.2463)]
DECODE_2 = [(1, 128, 0.0070), (1, 512, 0.0074), (8, 128, 0.0099), (8, 512, 0.0131), (32, 128, 0.0189),
            (32, 512, 0.0318)]


# Tight SLOs for tests that need a plan but not a given one: the probes' length follows the SLOs' slack,
# so this plan takes a fraction of the default SLOs' (3 s against 15 s for the tiny model on two cores).
QUICK_PLAN = {"slo": {"tiers": {"interactive": {"ttft_ms": 200, "tpot_ms": 20}, "standard": {"ttft_ms": 200, "tpot_ms": 20}}}}

@pytest.fixture()
def two_core_machine(tmp_path: Path) -> tuple[Path, Path]:
    """A checkpoint folder with bench-llama's config.json, and a profile of it on one core and on two."""
    model = tmp_path / "bench-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(BENCH_LLAMA))
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({
        "format": "mm-serve-profile/1", "name": "cpu-1thread", "device": "2 cores", "memory_bytes": 16 << 30,
        "model": BENCH_LLAMA, "dtype": "float32",
        "prefill": [{"tokens": t, "batch": 1, "seconds": s} for t, s in PREFILL],
        "decode": [{"batch": b, "context": c, "seconds": s} for b, c, s in DECODE],
        "tensor_parallel": [{"degree": 2, "prefill": [{"tokens": t, "batch": 1, "seconds": s} for t, s in PREFILL_2],
                             "decode": [{"batch": b, "context": c, "seconds": s} for b, c, s in DECODE_2]}],
    }))
    return model, profile


# The embedded model (mm_serve/models/embedded) on one torch thread and on two of a quiet 2-core Xeon, as
# `mm-serve serve` profiles it for the placement (PROFILE_SIZES; 2026-12-07): seconds per pass.
EMBEDDED_PREFILL = [(32, 0.00247), (256, 0.01178)]
EMBEDDED_DECODE = [(1, 128, 0.00105), (8, 128, 0.00135), (32, 128, 0.00276)]
EMBEDDED_ENCODE = [(1, 0.00298), (4, 0.00809)]
EMBEDDED_PREFILL_2 = [(32, 0.00199), (256, 0.00737)]
EMBEDDED_DECODE_2 = [(1, 128, 0.00118), (8, 128, 0.00119), (32, 128, 0.00180)]
EMBEDDED_ENCODE_2 = [(1, 0.00249), (4, 0.00533)]


@pytest.fixture()
def embedded_profile(tmp_path: Path) -> Path:
    """The embedded model's placement profile on a 2-core machine (the points above)."""
    def points(prefill: list[tuple[int, float]], decode: list[tuple[int, int, float]],
               encode: list[tuple[int, float]]) -> dict[str, Any]:
        return {"prefill": [{"tokens": t, "batch": 1, "seconds": s} for t, s in prefill],
                "decode": [{"batch": b, "context": c, "seconds": s} for b, c, s in decode],
                "encode": [{"images": i, "seconds": s} for i, s in encode]}

    profile = tmp_path / "embedded-profile.json"
    profile.write_text(json.dumps({
        "format": "mm-serve-profile/1", "name": "cpu-1thread", "device": "2 CPU cores, 1 torch thread(s)",
        "memory_bytes": 16 << 30, "dtype": "float32",
        "model": json.loads((EMBEDDED_MODEL_DIR / "config.json").read_text()),
        **points(EMBEDDED_PREFILL, EMBEDDED_DECODE, EMBEDDED_ENCODE),
        "tensor_parallel": [{"degree": 2, **points(EMBEDDED_PREFILL_2, EMBEDDED_DECODE_2, EMBEDDED_ENCODE_2)}],
    }))
    return profile


@pytest.fixture()
def busy_cores_count_as_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """No share of busy cores marks a profile (the limit is above any share): tests of the cache itself then
    pass on a machine that other jobs keep busy while they measure."""
    from mm_serve.planner import auto_placement

    monkeypatch.setattr(auto_placement, "BUSY_SHARE_LIMIT", 1.0)


def _config(workload: str, ttft_ms: float, tpot_ms: float, **more: Any) -> Any:
    tier = {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "attainment": 0.9}
    return config_from_dict({"placement": {"workload": workload},
                             "slo": {"tiers": {"interactive": tier, "standard": tier}}, **more})


def test_chatbot_at_tpot_50_ms_on_two_cores_runs_colocated(two_core_machine: tuple[Path, Path]) -> None:
    """Chatbot at TTFT 1 s / TPOT 50 ms with the front end on cores of its own (no stall priced): one worker
    on both cores is predicted ahead of 1 prefill + 1 decode worker on a core each, so the service runs
    colocated."""
    model, profile = two_core_machine
    cfg = _config("chatbot", 1000, 50, placement={"workload": "chatbot", "front_end_ms_per_token": 0})
    choice = choose_placement(cfg, model, profile, [0, 1])
    (shared,) = set(choice.predicted) - {"colocated", "1P+1D"}
    assert shared.startswith("2P+1D shared core (")  # the decode worker beside the second prefill worker
    assert choice.predicted["colocated"] > choice.predicted["1P+1D"] > choice.predicted[shared] > 0
    # colocated is the one worker on both cores the service runs, priced from the two-thread points (about
    # 1.8x one thread): 2.85 req/s, not the 3.95 that dividing one thread's times by two gives, nor the
    # 3.65 of two one-thread instances (the planner's best colocated pool, which the service does not run)
    assert choice.predicted["colocated"] == pytest.approx(2.85, abs=0.05)
    assert choice.candidates["colocated"] == "one worker on cores [0, 1] (planned as one TP2 PP1 instance)"
    assert (choice.mode, choice.name, choice.workload, choice.cores) == ("colocated", "colocated", "chatbot", 2)
    served = apply_placement(cfg, **choice.keys)
    assert served.mode == "colocated" and served.compute.prefill_cpus == served.compute.decode_cpus == []
    line = choice.describe()
    assert line.startswith("placement colocated chosen by the planner (colocated ") and "1P+1D" in line
    health = choice.as_dict()
    assert health["source"] == "planner" and health["chosen"] == "colocated"
    assert health["predicted_goodput"] == choice.predicted and health["slo"]["tpot_s"] == 0.05
    assert health["profile_measured_under_load"] is None  # measured on quiet cores


def test_a_front_end_that_stalls_the_colocated_threads_turns_chatbot_to_one_prefill_and_one_decode_worker(
    two_core_machine: tuple[Path, Path],
) -> None:
    """The same profile and SLOs with the default front end (0.35 ms of CPU per streamed token, which stalls the
    colocated worker's two threads at every step): colocated is predicted below 1 prefill + 1 decode worker,
    so that unit runs; the one-thread workers' predictions do not move, and the colocated instance's equals
    the evaluator's with that stall."""
    model, profile = two_core_machine
    apart = choose_placement(_config("chatbot", 1000, 50, placement={"workload": "chatbot", "front_end_ms_per_token": 0}),
                             model, profile, [0, 1])
    cfg = _config("chatbot", 1000, 50)
    assert cfg.placement.front_end_ms_per_token == 0.35
    choice = choose_placement(cfg, model, profile, [0, 1])
    assert choice.predicted["1P+1D"] > choice.predicted["colocated"] > 0
    assert choice.predicted["colocated"] < 0.8 * apart.predicted["colocated"]
    assert {k: v for k, v in choice.predicted.items() if k != "colocated"} == {
        k: v for k, v in apart.predicted.items() if k != "colocated"}
    assert (choice.mode, choice.name, choice.prefill_cpus, choice.decode_cpus) == ("disaggregated", "1P+1D", [0], [1])
    shape = load_model_shape(str(model))
    spec = PlanSpec(shape=shape, hardware=get_hardware(str(profile)), workload=make_workload("chatbot", 0, shape.max_context),
                    slo=SLO(1.0, 0.05), gpus_per_node=2, prefill_token_budget=cfg.scheduler.prefill_token_budget,
                    prefill_max_batch=cfg.scheduler.prefill_batch_size, decode_max_batch=cfg.scheduler.decode_max_concurrent,
                    colocated_mixed_tokens=cfg.scheduler.mixed_step_tokens, page_size=cfg.kv_cache.page_size,
                    front_end_s_per_token=0.00035)
    evaluator = GoodputEvaluator(spec)
    assert evaluator.colocated_goodput(ParallelConfig(2, 1), False) == choice.predicted["colocated"]
    one = evaluator.decode_server(ParallelConfig(1, 1), False).timing
    assert one == evaluator.model.decode_timing(ParallelConfig(1, 1))  # a one-thread worker: no stall
    two = evaluator.decode_server(ParallelConfig(2, 1), False).timing
    assert two.step_time(16, 16 * 400) - evaluator.model.decode_timing(ParallelConfig(2, 1)).step_time(
        16, 16 * 400) == pytest.approx(16 * 0.00035, rel=1e-9)


def test_six_cores_plan_with_the_stall_priced(two_core_machine: tuple[Path, Path]) -> None:
    """On six cores the search also tries instances of tensor and pipeline parallelism together; the stall
    is priced where there are no pipeline stages and the plan completes (it once raised there)."""
    model, profile = two_core_machine
    choice = choose_placement(_config("chatbot", 1000, 50), model, profile, list(range(6)))
    assert choice.cores == 6 and choice.predicted["colocated"] > 0
    assert choice.name in choice.predicted and max(choice.predicted.values()) == choice.predicted[choice.name]


def test_summarization_at_a_tight_tpot_runs_one_prefill_and_one_decode_worker(
    two_core_machine: tuple[Path, Path],
) -> None:
    """Long prompts at TPOT 30 ms: a colocated prefill stalls every running request past the TPOT SLO, so
    1 prefill + 1 decode worker is predicted ahead and runs, each on one of this process's cores. The
    config sets the shared-core niceness itself, so the planner offers no shared core (its rule would
    override the config's)."""
    model, profile = two_core_machine
    cfg = _config("summarization", 20_000, 30, compute={"prefill_worker_nice": 12})
    choice = choose_placement(cfg, model, profile, [4, 7])
    assert set(choice.predicted) == {"colocated", "1P+1D"}
    assert choice.predicted["1P+1D"] > choice.predicted["colocated"]
    assert (choice.mode, choice.prefill_workers, choice.decode_workers) == ("disaggregated", 1, 1)
    assert (choice.prefill_cpus, choice.decode_cpus) == ([4], [7])
    served = apply_placement(cfg, **choice.keys)
    assert served.mode == "disaggregated" and (served.compute.prefill_cpus, served.compute.decode_cpus) == ([4], [7])
    assert served.slo == cfg.slo and served.placement == cfg.placement  # the rest of the config is kept
    assert served.compute.prefill_worker_nice == 12 and served.scheduler.decode_step_pacing == 0.0
    paced = _config("summarization", 20_000, 30, scheduler={"decode_step_interval_ms": 20})
    assert set(choose_placement(paced, model, profile, [4, 7]).predicted) == {"colocated", "1P+1D"}


def test_summarization_on_two_cores_shares_the_decode_core_with_pacing_and_niceness_by_rule(
    two_core_machine: tuple[Path, Path],
) -> None:
    """Summarization at TTFT 7 s / TPOT 70 ms on this profile: prefill on both cores and the decode worker
    beside the second, paced, with that prefill worker niced 5 above it, is predicted ahead of colocated
    and of 1P+1D (the planner's output for what configs/summarization.yaml once set by hand); the
    service runs it with those keys."""
    from mm_serve.cluster.worker_specs import prefill_nice
    from mm_serve.planner.shared_core import PACINGS

    model, profile = two_core_machine
    cfg = _config("summarization", 7_000, 70)
    choice = choose_placement(cfg, model, profile, [4, 7])
    assert choice.shared_core is not None and choice.shared_core.pacing in PACINGS[1:]
    name = f"2P+1D shared core (paced {choice.shared_core.pacing:g})"
    assert choice.name == name and set(choice.predicted) == {"colocated", "1P+1D", name}
    assert choice.predicted[name] > max(choice.predicted["colocated"], choice.predicted["1P+1D"])
    assert choice.keys == {"mode": "disaggregated", "prefill_workers": 2, "decode_workers": 1, "prefill_cpus": [4, 7],
                           "decode_cpus": [7], "decode_step_pacing": choice.shared_core.pacing,
                           "prefill_worker_nice": 10}
    assert choice.candidates[name] == (f"prefill on cores [4, 7], decode on core 7 beside a prefill worker niced to "
                                       f"10, steps paced at {choice.shared_core.pacing:g} x the TPOT SLO")
    served = apply_placement(cfg, **choice.keys)
    assert served.scheduler.decode_step_pacing == choice.shared_core.pacing and served.compute.worker_nice == 5
    assert prefill_nice(served.compute, [7], [7]) == 10 and prefill_nice(served.compute, [4], [7]) == 5
    assert choice.describe().startswith(f"placement {name} chosen by the planner (colocated ")
    health = choice.as_dict()
    assert health["chosen"] == name and health["decode_step_pacing"] == choice.shared_core.pacing


def test_the_colocated_candidate_is_simulated_with_the_configs_mixed_step_budget(
    two_core_machine: tuple[Path, Path],
) -> None:
    """The colocated engine the service would run takes mixed steps of ``scheduler.mixed_step_tokens``, and
    so does its simulation: on this profile (summarization, TTFT 7 s / TPOT 70 ms) steps of 128 tokens are
    predicted ahead of prefill steps apart (each step saves the decode pass's constant), 2,048-token steps
    close to apart (a summarization prompt then goes in one or two chunks)."""
    model, profile = two_core_machine
    colocated = {budget: choose_placement(_config("summarization", 7_000, 70, scheduler={"mixed_step_tokens": budget}),
                                          model, profile, [0, 1]).predicted["colocated"]
                 for budget in (0, 128, 2048)}
    assert colocated[128] > 1.1 * colocated[0] > 0
    assert colocated[2048] == pytest.approx(colocated[0], rel=0.1)


def test_the_embedded_model_at_the_default_slo_is_predicted_at_what_two_cores_serve(embedded_profile: Path) -> None:
    """`mm-serve serve` on the embedded model with the default config (llava, TTFT 4 s / TPOT 0.25 s): its
    prefills and decode steps take milliseconds, so the SLO slack holds hundreds of requests. Probes of 400
    requests then met the SLOs at any rate, and the searches answered 256 times their bounds (colocated
    58 215 req/s, 1P+1D 18 million); the start line showed those. Every candidate is now predicted at the
    tens to hundreds of requests/s that this 2-core machine serves."""
    choice = choose_placement(config_from_dict({}), EMBEDDED_MODEL_DIR, embedded_profile, [0, 1])
    assert (choice.workload, choice.slo.ttft_s, choice.slo.tpot_s) == ("llava", 4.0, 0.25)
    assert set(choice.predicted) >= {"colocated", "1P+1D"} and len(choice.predicted) == 3
    for name, rate in choice.predicted.items():
        assert 10 < rate < 1000, f"{name}: {rate:.2f} req/s"


def test_phase_goodputs_stay_within_the_profiled_throughput_and_hold_over_a_long_run(embedded_profile: Path) -> None:
    """One core of that machine, each phase alone: the prefill goodput is at most full batches of average
    requests back to back, the decode goodput at most a full running batch's tokens/s over a mean answer's
    steps (the profiled step times allow no more); and all the drawn requests (20 000) arriving at that
    rate still meet the phase's SLO for the target share: the rate is sustained, not a short run's artefact."""
    cfg = config_from_dict({})
    shape = load_model_shape(str(EMBEDDED_MODEL_DIR))
    tier = cfg.slo.of(cfg.slo.default)
    spec = PlanSpec(
        shape=shape, hardware=get_hardware(str(embedded_profile)),
        workload=make_workload("llava", shape.image_tokens, shape.max_context), slo=SLO(tier.ttft_s, tier.tpot_s),
        attainment=tier.attainment, nodes=1, gpus_per_node=2, seed=cfg.seed,
        prefill_token_budget=cfg.scheduler.prefill_token_budget, prefill_max_batch=cfg.scheduler.prefill_batch_size,
        decode_max_batch=cfg.scheduler.decode_max_concurrent,
    )
    ev, one = GoodputEvaluator(spec), ParallelConfig(1, 1)
    prefill, decode = ev.prefill_server(one, False), ev.decode_server(one, False)

    k = prefill.max_batch  # requests in a full prefill batch of average requests (the budget holds them)
    assert k * ev.mean_prompt <= prefill.token_budget
    full_batch_s = prefill.timing.stage_time(k * ev.mean_prompt, k * ev.mean_prompt_sq, k, k * ev.mean_images)
    prefill_rate = ev.prefill_goodput(one, False)
    assert 0 < prefill_rate <= k / full_batch_s * (1 + 1e-9)

    steps = sum(max(s.output_tokens - 1, 0) for s in ev.specs) / len(ev.specs)  # decode steps of a mean answer
    b = decode.max_batch
    full_step_s = decode.timing.step_time(b, b * ev.mean_prompt)  # each running request reads its prompt's KV at least
    decode_rate = ev.decode_goodput(one, False)
    assert 0 < decode_rate <= b / (full_step_s * steps) * (1 + 1e-9)

    everyone = len(ev.specs)
    assert simulate_prefill(prefill, ev.requests(prefill_rate, everyone)).attainment(spec.slo, "prefill") >= 0.9
    assert simulate_decode(decode, ev.requests(decode_rate, everyone)).attainment(spec.slo, "decode") >= 0.9


def test_placement_keys_in_the_file_or_flags_pin_the_placement(tmp_path: Path) -> None:
    """Any placement key given (file or flag) pins it; the service defaults pin none; ray places by config."""
    assert pinned_keys(load_config(None)) == []
    assert pinned_keys(load_config(None, {"mode": "colocated"})) == ["mode"]
    file = tmp_path / "c.yaml"
    file.write_text("compute:\n  decode_cpus: [1]\n  prefill_cpus: [0]\nseed: 3\n")
    assert pinned_keys(load_config(file)) == ["compute.prefill_cpus", "compute.decode_cpus"]
    assert pinned_keys(load_config(None, {"cluster.backend": "ray"})) == ["cluster.backend"]
    shipped = load_config(Path(__file__).parents[2] / "configs" / "default.yaml")
    assert "mode" in pinned_keys(shipped)  # the file of defaults writes every key: serving with it pins 1P+1D


@pytest.mark.usefixtures("busy_cores_count_as_quiet")
def test_a_cached_profile_is_read_and_a_new_checkpoint_is_measured(tiny_llama: Path, tmp_path: Path) -> None:
    """The first call measures the checkpoint and writes a profile that the planner fits; the second
    reads it; another config.json (another key) measures again."""
    lines: list[str] = []
    path, measured = cached_profile(tiny_llama, "float32", 2, tmp_path, lines.append)
    assert measured and path.parent == tmp_path and path.stem.endswith(profile_key(tiny_llama, "float32", 2))
    assert lines[0].startswith("profiling this machine for the placement") and str(path) in lines[0]
    assert any("decode  batch= 32 context=  512" in line for line in lines)
    rows = json.loads(path.read_text())
    assert [r["tokens"] for r in rows["prefill"]] == [32, 256, 1024] and len(rows["decode"]) == 6
    # the same sizes on both cores' threads: the colocated worker's instance (degree 2)
    [two] = rows["tensor_parallel"]
    assert two["degree"] == 2 and [r["tokens"] for r in two["prefill"]] == [32, 256, 1024] and len(two["decode"]) == 6
    assert any(line.startswith("  [2 threads] decode  batch= 32 context=  512") for line in lines)
    assert set(get_hardware(str(path)).tensor_parallel) == {2}
    assert parallel_degrees(1, 8) == [] and parallel_degrees(2, 8) == [2] and parallel_degrees(12, 8) == [2, 4, 8]
    assert parallel_degrees(16, 12) == [2, 4]  # the degrees that divide the heads
    again: list[str] = []
    assert cached_profile(tiny_llama, "float32", 2, tmp_path, again.append) == (path, False) and again == []
    assert profile_key(tiny_llama, "bfloat16", 2) != profile_key(tiny_llama, "float32", 2)
    assert profile_key(tiny_llama, "float32", 4) != profile_key(tiny_llama, "float32", 2)
    # another build of the compiled kernels (a change of their sources or flags) is timed again
    key = profile_key(tiny_llama, "float32", 2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_extension, "CFLAGS", [*cpu_extension.CFLAGS, "-DMM_SERVE_OTHER_BUILD"])
        assert profile_key(tiny_llama, "float32", 2) != key


def test_a_server_without_placement_keys_runs_and_reports_the_planners_choice(tiny_llama: Path, tmp_path: Path) -> None:
    """`mm-serve serve` with no placement key profiles the machine, prints the choice with each candidate's
    predicted goodput, runs it (the workers /health lists), answers, and reports the choice in /health."""
    (tmp_path / "quick-plan.yaml").write_text(json.dumps(QUICK_PLAN))  # JSON is YAML
    proc = ServerProcess(tiny_llama, "--config", str(tmp_path / "quick-plan.yaml"), log_dir=tmp_path,
                         auto_placement=True)
    try:
        proc.wait_ready()
        health = httpx.get(f"{proc.url}/health", timeout=10).json()
        placement = health["placement"]
        assert placement["source"] == "planner" and placement["workload"] == "chatbot"
        predicted = set(placement["predicted_goodput"])
        assert "colocated" in predicted and len(predicted) == 3  # colocated, the planner's unit, a shared core
        assert any(name.startswith("2P+1D shared core (") for name in predicted)
        expected = {"colocated0"} if placement["mode"] == "colocated" else {
            *(f"prefill{i}" for i in range(placement["prefill_workers"])),
            *(f"decode{i}" for i in range(placement["decode_workers"]))}
        assert set(health["workers"]) == expected
        assert f"placement {placement['chosen']} chosen by the planner" in proc.output()
        assert served_placement_name(proc.url, "auto") == f"auto-{placement['chosen']}"  # how `mm-serve bench` names it
        r = httpx.post(f"{proc.url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        # an image to this text-only model: refused before it is fetched (the host does not resolve)
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://image.invalid/a.png"}},
                                              {"type": "text", "text": "What is this?"}]}]
        r = httpx.post(f"{proc.url}/v1/chat/completions", timeout=60, json={"model": "tiny", "messages": image})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image", r.text
        assert r.json()["error"]["message"] == "this model is text-only; it does not take images"
    finally:
        assert proc.stop() == 0


def test_an_unwritable_profile_folder_is_reported_before_measuring(tiny_llama: Path, tmp_path: Path) -> None:
    """A profile folder under a file cannot be created: PlannerError at once, nothing measured."""
    from mm_serve.planner.errors import PlannerError

    (tmp_path / "afile").write_text("")
    lines: list[str] = []
    with pytest.raises(PlannerError, match="cannot write profiles to .*afile/sub"):
        cached_profile(tiny_llama, "float32", 2, tmp_path / "afile" / "sub", lines.append)
    assert lines == []


def test_an_unreadable_cached_profile_is_measured_again(tiny_llama: Path, tmp_path: Path) -> None:
    path, _ = cached_profile(tiny_llama, "float32", 2, tmp_path, lambda line: None)
    path.write_text(path.read_text()[:40])  # truncated
    lines: list[str] = []
    assert cached_profile(tiny_llama, "float32", 2, tmp_path, lines.append) == (path, True)
    assert lines[0] == f"the cached profile {path} is unreadable: measuring again"
    assert json.loads(path.read_text())["dtype"] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp file left


@pytest.mark.usefixtures("busy_cores_count_as_quiet")
def test_the_cache_serves_another_copy_of_the_checkpoint_after_the_first_is_deleted(
    tiny_llama: Path, tmp_path: Path,
) -> None:
    """The cache is keyed by config.json's digest, so two clones share it: the file carries the config
    itself, and a clone's placement still plans after the checkout that measured it is gone; an older
    file that names a vanished checkout is measured again."""
    import shutil

    first = tmp_path / "clone-a" / "m"
    shutil.copytree(tiny_llama, first)
    cache = tmp_path / "profiles"
    path, measured = cached_profile(first, "float32", 2, cache, lambda line: None)
    assert measured and json.loads(path.read_text())["model"] == json.loads((tiny_llama / "config.json").read_text())
    shutil.rmtree(tmp_path / "clone-a")
    second = tmp_path / "clone-b" / "m"
    shutil.copytree(tiny_llama, second)
    assert cached_profile(second, "float32", 2, cache, lambda line: None) == (path, False)
    cfg = config_from_dict(QUICK_PLAN, {"placement.workload": "chatbot"})
    choice = choose_placement(cfg, second, path, [0, 1])  # plans from the clone's copy: any candidate may win
    assert choice.name in choice.predicted and choice.predicted[choice.name] == max(choice.predicted.values())
    old = json.loads(path.read_text())
    path.write_text(json.dumps({**old, "model": str(tmp_path / "clone-a" / "m")}))  # a path that is gone
    lines: list[str] = []
    assert cached_profile(second, "float32", 2, cache, lines.append) == (path, True)
    assert lines[0] == f"the cached profile {path} is unreadable: measuring again"


def test_one_usable_core_runs_colocated_without_a_profile(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    import mm_serve.planner.auto_placement as auto
    from mm_serve.cli.serve import _placement

    monkeypatch.setattr(auto, "usable_cores", lambda: [3])
    cfg, health = _placement(load_config(None, {"placement.profile_dir": str(tmp_path)}), tiny_llama)
    assert cfg.mode == "colocated" and health == {"source": "rule", "chosen": "colocated", "mode": "colocated",
                                                  "reason": "one usable core"}
    assert list(tmp_path.iterdir()) == []


def test_a_tower_of_patches_and_grids_is_profiled_without_encode_points(tmp_path: Path) -> None:
    """Qwen2-VL's tower takes patches and grids, not a square image batch: the profile keeps its prefill
    and decode points, says the tower was not timed, and fits (it was thrown away, every start)."""
    from tests.factories import build_checkpoint

    model = build_checkpoint("qwen2-vl", tmp_path / "qwen2-vl")
    lines: list[str] = []
    path, measured = cached_profile(model, "float32", 2, tmp_path / "profiles", lines.append)
    rows = json.loads(path.read_text())
    assert measured and rows["encode"] == [] and len(rows["prefill"]) >= 2 and len(rows["decode"]) == 6
    assert any(line.startswith("  encode  not timed:") for line in lines)
    assert get_hardware(str(path)).name


def _spinners(cores: int, seconds: float) -> list[Any]:
    """One busy-looping process per core, for ``seconds``: another program on the machine."""
    import subprocess
    import sys

    loop = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
    return [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(cores)]


def test_a_profile_measured_on_busy_cores_is_used_once_then_measured_again(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While other processes keep this process's cores busy, the profile is marked with their share and
    the next start measures it again (a 40x slower point kept for good flipped placements), so its plan is not
    saved; measured on quiet cores (here: whatever else runs, counted as quiet), the new profile is cached and read."""
    from mm_serve.planner import auto_placement
    from mm_serve.planner.auto_placement import BUSY_SHARE_LIMIT, UNDER_LOAD_KEY, usable_cores

    spinners = _spinners(2 * len(usable_cores()), 120)
    try:
        lines: list[str] = []
        path, measured = cached_profile(tiny_llama, "float32", 2, tmp_path, lines.append)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    share = json.loads(path.read_text())[UNDER_LOAD_KEY]
    assert measured and BUSY_SHARE_LIMIT < share <= 1.0
    assert any(line.startswith(f"other processes kept {share:.0%} of this process's cores busy") for line in lines)
    tight = config_from_dict(QUICK_PLAN, {"placement.workload": "chatbot"})
    assert choose_placement(tight, tiny_llama, path, [0, 1]).as_dict()["profile_measured_under_load"] == share
    assert not list(tmp_path.glob("*.plan-*.json"))  # no later start reads a plan of that profile: none saved
    lines = []
    monkeypatch.setattr(auto_placement, "BUSY_SHARE_LIMIT", 1.0)
    assert cached_profile(tiny_llama, "float32", 2, tmp_path, lines.append) == (path, True)
    assert lines[0] == (f"the cached profile {path} was measured while other processes kept {share:.0%} of its "
                        "cores busy: measuring again")
    assert UNDER_LOAD_KEY not in json.loads(path.read_text())  # measured on quiet cores this time
    assert cached_profile(tiny_llama, "float32", 2, tmp_path, lines.append) == (path, False)


def test_a_plan_is_saved_beside_its_profile_and_reused_until_an_input_changes(embedded_profile: Path) -> None:
    """The placement search (seconds on a 2-core machine: its probes run thousands of requests) runs once per
    profile and inputs: the next start reads the saved choice; another SLO, a changed profile or a saved plan
    that does not read is planned again."""
    cfg = config_from_dict(QUICK_PLAN)
    first = choose_placement(cfg, EMBEDDED_MODEL_DIR, embedded_profile, [0, 1])
    saved = list(embedded_profile.parent.glob(f"{embedded_profile.stem}.plan-*.json"))
    assert not first.plan_reused and len(saved) == 1
    again = choose_placement(cfg, EMBEDDED_MODEL_DIR, embedded_profile, [0, 1])
    assert again.plan_reused and "the plan saved by an earlier start" in again.describe()
    assert (again.name, again.predicted, again.keys, again.slo) == (first.name, first.predicted, first.keys, first.slo)
    assert again.as_dict() == {**first.as_dict(), "plan_reused": True}
    looser = config_from_dict({"slo": {"tiers": {"interactive": {"ttft_ms": 200, "tpot_ms": 20},
                                                 "standard": {"ttft_ms": 300, "tpot_ms": 30}}}})
    assert not choose_placement(looser, EMBEDDED_MODEL_DIR, embedded_profile, [0, 1]).plan_reused
    saved[0].write_text("{torn")
    assert not choose_placement(cfg, EMBEDDED_MODEL_DIR, embedded_profile, [0, 1]).plan_reused
    assert choose_placement(cfg, EMBEDDED_MODEL_DIR, embedded_profile, [0, 1]).plan_reused


def test_saved_plans_beyond_the_last_used_sixteen_are_deleted(tmp_path: Path) -> None:
    """Plans of older profiles, SLOs and planner versions do not pile up beside a profile: a save keeps
    the PLANS_KEPT used last and leaves other profiles' plans alone."""
    from mm_serve.planner.auto_placement import PLANS_KEPT, _prune_plans

    plans = [tmp_path / f"prof.plan-{k:016x}.json" for k in range(PLANS_KEPT + 3)]
    for age, plan in enumerate(plans):  # plans[0] is the newest
        plan.write_text("{}")
        os.utime(plan, (1e9 - age, 1e9 - age))
    other = tmp_path / "other-prof.plan-0000000000000000.json"
    other.write_text("{}")
    os.utime(other, (1.0, 1.0))
    _prune_plans(plans[0])
    assert sorted(tmp_path.glob("prof.plan-*.json")) == sorted(plans[:PLANS_KEPT])
    assert other.exists()


@pytest.mark.parametrize(("share", "exit_code", "says"), [
    (0.5, 0, "was measured while other processes kept 50% of its cores busy"),
    ("x", 2, "'measured_under_load' must be a positive finite number"),
    (1.5, 2, "'measured_under_load' must be a share between 0 and 1, got 1.5"),
])
def test_plan_warns_of_a_profile_measured_under_load(two_core_machine: tuple[Path, Path], share: object,
                                                     exit_code: int, says: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`mm-serve plan --hardware` with a profile that `mm-serve profile` marked as measured beside busy cores
    says so on stderr (its times are slow); a share that is no number in (0, 1] is a profile error."""
    from mm_serve.cli.main import main

    model, profile = two_core_machine
    profile.write_text(json.dumps({**json.loads(profile.read_text()), "measured_under_load": share}))
    assert main(["plan", "--model", str(model), "--hardware", str(profile), "--slo-ttft", "1", "--slo-tpot", "0.05",
                 "--workload", "chatbot", "--nodes", "1", "--gpus-per-node", "2", "--num-requests", "200"]) == exit_code
    assert says in capsys.readouterr().err
