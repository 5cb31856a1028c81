"""``mm-serve plan`` through the CLI entry point: output formats and user errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mm_serve.cli.main import main
from mm_serve.config import load_config

Configs = dict[str, dict[str, Any]]
BASE = ["plan", "--slo-ttft", "0.25", "--slo-tpot", "0.1", "--hardware", "h100-80gb",
        "--gpus-per-node", "4"]


@pytest.fixture
def tiny_dir(tmp_path: Path, configs: Configs) -> Path:
    d = tmp_path / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(configs["tiny-llama"]))
    return d


def test_json_plan_and_config(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_yaml = tmp_path / "plan.yaml"
    assert main([*BASE, "--model", str(tiny_dir), "--json", "--write-config", str(out_yaml)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "tiny-llama" and data["hardware"] == "h100-80gb"
    assert data["per_gpu_goodput"] > 0 and data["colocated_per_gpu_goodput"] > 0
    assert data["disaggregated_over_colocated"] == pytest.approx(
        data["per_gpu_goodput"] / data["colocated_per_gpu_goodput"])
    unit = data["unit"]
    assert data["per_gpu_goodput"] == pytest.approx(unit["goodput"] / unit["gpus"])
    # the shortlist simulated whole: the chosen unit is on it and the best per GPU
    assert data["per_gpu_goodput"] == pytest.approx(max(s["per_gpu_goodput"] for s in data["shortlist"]))
    assert any(s["gpus"] == unit["gpus"] and s["goodput"] == pytest.approx(unit["goodput"]) for s in data["shortlist"])
    placement = data["placement"]
    assert {p["role"] for p in placement} == {"prefill", "decode"}
    assert all(p["num_gpus"] == p["tp"] * p["pp"] == len(p["gpus"]) for p in placement)
    gpus = [g for p in placement for g in p["gpus"]]
    assert len(gpus) == len(set(gpus)) == data["gpus_used"] <= 4
    assert data["config_written"] == str(out_yaml)
    cfg = load_config(out_yaml)
    roles = [p["role"] for p in placement]
    assert cfg.compute.prefill_workers == roles.count("prefill")
    assert cfg.compute.decode_workers == roles.count("decode")
    assert cfg.dtype == "float32" and cfg.model == str(tiny_dir)


def test_text_plan(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BASE, "--model", str(tiny_dir / "config.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Placement for tiny-llama on 1 x 4 h100-80gb (affinity high)")
    assert "Per-GPU goodput:" in out and "Colocated best:" in out and "prefill" in out
    assert "; prefill and decode steps apart)" in out  # mm-serve plan prices the paper's colocated baseline


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "{missing}"], "no config.json at"),
        (["--model", "{bad}"], "not valid JSON"),
        (["--hardware", "tpu-v5"], "unknown hardware 'tpu-v5'"),
        (["--hardware", "{bad}"], "not valid JSON"),
        (["--hardware", "{adir}"], "adir.jsonl is not a file (give a profile JSON file"),
        (["--slo-ttft", "0"], "SLOs must be > 0"),
        (["--slo-tpot", "-1"], "SLOs must be > 0"),
        (["--attainment", "1.5"], "attainment must be in (0, 1]"),
        (["--nodes", "0"], "nodes must be in 1..1024, got 0"),
        (["--nodes", "100000"], "nodes must be in 1..1024, got 100000"),
        (["--gpus-per-node", "65"], "gpus per node must be in 1..64"),
        (["--num-requests", "100000000"], "num_requests must be in 20..50000"),
        (["--slo-ttft", "inf"], "at most 3600 seconds"),
        (["--write-config", ""], "--write-config needs a file path"),
        (["--write-config", "{nodir}"], "does not exist"),
        (["--write-config", "{underfile}"], "is not a directory"),
        (["--workload", "{zero}"], "at least one prompt token"),
        (["--workload", "{negstamp}"], "'timestamp' must be a number >= 0"),
        (["--workload", "{samestamp}"], "at least two different 'timestamp' values"),
        (["--workload", "{halfstamp}"], "1 of 2 rows have a 'timestamp'"),
        (["--workload", "{long}"], "exceeds tiny-llama's context"),
        (["--workload", "{images}"], "has no vision tower"),
        (["--workload", "llava"], "needs a model with a vision tower"),
        (["--workload", "nope"], "unknown workload 'nope'"),
        (["--burstiness", "0"], "burstiness (CV) must be in 0.001..100, got 0.0"),
        (["--burstiness", "1e-300"], "burstiness (CV) must be in 0.001..100"),
        (["--model", "{huge}"], "does not fit in one instance of at most"),
        (["--model", "{huge}", "--nodes", "4", "--affinity", "low"], "fits only with a whole node"),
        (["--model", "{huge}", "--nodes", "5", "--slo-ttft", "10", "--slo-tpot", "1"],
         "the prefill candidates take 12, 14, 18 GPUs, the decode candidates 12, 14, 16"),
        (["--model", "{fp8}"], "'torch_dtype' 'float8_e4m3fn' is not supported"),
        (["--slo-ttft", "0.0001"], "no prefill configuration of tiny-llama on h100-80gb meets TTFT "
         "0.0001 s for 90% of requests: of the 4 that hold the model (1-3 GPUs), none meets it for "
         "any request even idle"),
        (["--workload", "{binary}"], "not UTF-8 text"),
        (["--workload", "{adir}"], "is a directory, not a JSONL file"),
        (["--burstiness", "inf"], "burstiness (CV) must be in 0.001..100, got inf"),
        (["--model", "{shortctx}", "--workload", "llava"], "an image is 576 tokens, and with its "
         "question and answer a request needs about 620, more than the model's 128-token context"),
        (["--write-config", "/dev/null"], "not a regular file"),
        (["--write-config", "{newdir}/"], "is a directory (give a file path)"),
        (["--slo-tpot", "0.00001"], "no decode configuration of tiny-llama on h100-80gb meets TPOT"),
        (["--slo-ttft", "0.0001", "--nodes", "2", "--affinity", "low"], "no prefill configuration"),
        (["--gpus-per-node", "1"], "needs at least 2 GPUs"),
        (["--front-end-ms-per-token", "-1"], "--front-end-ms-per-token must be in 0..100 milliseconds, got -1.0"),
        (["--front-end-ms-per-token", "nan"], "--front-end-ms-per-token must be in 0..100 milliseconds, got nan"),
    ],
)
def test_user_errors_exit_2_with_one_line(
    tiny_dir: Path, tmp_path: Path, configs: Configs, capsys: pytest.CaptureFixture[str],
    args: list[str], message: str,
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    huge = tmp_path / "huge.json"  # ~400B parameters: no GPU holds it
    huge.write_text(json.dumps({**configs["llama-2-7b"], "hidden_size": 16384,
                                "intermediate_size": 53248, "num_hidden_layers": 126,
                                "num_attention_heads": 128}))
    shortctx = tmp_path / "shortctx.json"
    llava = configs["llava-hf"]
    shortctx.write_text(json.dumps({**llava, "text_config": {**llava["text_config"],
                                                             "max_position_embeddings": 128}}))
    fp8 = tmp_path / "fp8.json"
    fp8.write_text(json.dumps({**configs["llama-2-7b"], "torch_dtype": "float8_e4m3fn"}))
    rows = {"zero": [{"prompt_len": 0, "output_len": 10}],
            "negstamp": [{"prompt_len": 5, "output_len": 5, "timestamp": -3}],
            "samestamp": [{"prompt_len": 5, "output_len": 5, "timestamp": 0}] * 2,
            "halfstamp": [{"prompt_len": 5, "output_len": 5, "timestamp": 0},
                          {"prompt_len": 5, "output_len": 5}],
            "long": [{"prompt_len": 100_000, "output_len": 5}],
            "images": [{"prompt_len": 5, "output_len": 5, "num_images": 1}]}
    paths = {"{missing}": str(tmp_path / "nowhere"), "{bad}": str(bad), "{huge}": str(huge), "{fp8}": str(fp8), "{shortctx}": str(shortctx),
             "{nodir}": str(tmp_path / "nodir" / "x.yaml"), "{underfile}": str(bad / "x.yaml")}
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe")
    (tmp_path / "adir.jsonl").mkdir()
    paths.update({"{binary}": str(binary), "{adir}": str(tmp_path / "adir.jsonl"),
                  "{newdir}/": str(tmp_path / "newdir") + "/"})
    for name, lines in rows.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in lines))
        paths[f"{{{name}}}"] = str(path)
    argv = [*BASE, "--model", str(tiny_dir), *[paths.get(a, a) for a in args]]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert err.startswith("mm-serve: error: ") and "\n" not in err and "Traceback" not in err
    assert message in err


@pytest.mark.parametrize(("args", "message"), [
    (["--nodes", "two"], "argument --nodes: invalid int value: 'two' (see: mm-serve plan --help)"),
    (["--affinity", "medium"], "argument --affinity: invalid choice: 'medium'"),
])
def test_argument_errors_are_one_line_exit_2(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*BASE, "--model", str(tiny_dir), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mm-serve: error: ") and "\n" not in err and message in err


def test_loose_slos_warn_that_goodputs_are_upper_bounds(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a if a != "0.25" else "20" for a in BASE]
    assert main([*argv, "--model", str(tiny_dir), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["per_gpu_goodput"] > 0
    assert captured.err.startswith("mm-serve: warning: SLOs this loose")


def test_a_trace_replays_the_same_whatever_its_time_origin(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Epoch timestamps, a shifted origin or shuffled rows give the plan of the same
    trace starting at 0."""
    import random

    rng = random.Random(3)
    t, rows = 0.0, []
    for _ in range(200):
        t += rng.expovariate(1.0)
        rows.append({"prompt_len": rng.randint(20, 400), "output_len": rng.randint(5, 200), "timestamp": t})
    results = []
    for name, offset, shuffle in (("zero", 0.0, False), ("epoch", 1_764_500_000.0, False),
                                  ("shuffled", 1000.0, True)):
        lines = [{**r, "timestamp": r["timestamp"] + offset} for r in rows]
        if shuffle:
            rng.shuffle(lines)
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in lines))
        # tighter SLOs than BASE's: shorter probes (they follow the SLO slack), half the time
        assert main([*BASE, "--slo-ttft", "0.05", "--slo-tpot", "0.02", "--model", str(tiny_dir), "--workload",
                     str(path), "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        results.append((data["per_gpu_goodput"], data["colocated_per_gpu_goodput"]))
    assert results[0][0] > 0
    assert results[1] == pytest.approx(results[0], rel=1e-6)
    assert results[2] == pytest.approx(results[0], rel=1e-6)


def test_registered_model_name_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BASE, "--model", "embedded", "--workload", "llava", "--nodes", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "embedded" and data["per_gpu_goodput"] > 0


def test_a_tiling_checkpoint_plans_fewer_image_requests(tmp_path: Path, configs: Configs,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The same tower and decoder as LLaVA-NeXT (llava-v1.6-vicuna-7b's keys) plan each image at 2928
    tokens and 5 tower passes, not LLaVA-1.5's 576 and 1, so the llava workload's goodput drops."""
    goodputs = {}
    for name, extra in [("llava-1.5", {}), ("llava-next", {
            "model_type": "llava_next", "architectures": ["LlavaNextForConditionalGeneration"],
            "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]})]:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({**configs["llava-hf"], **extra}))
        args = ["plan", "--slo-ttft", "1.0", "--slo-tpot", "0.05", "--hardware", "a100-80gb", "--gpus-per-node", "2",
                "--workload", "llava", "--num-requests", "100", "--model", str(path)]
        assert main([*args, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        goodputs[name] = data["per_gpu_goodput"]
        assert (data["image_tokens"], data["tower_passes_per_image"]) == ((576, 1) if name == "llava-1.5" else (2928, 5))
    assert 0 < goodputs["llava-next"] < goodputs["llava-1.5"] / 2
    assert main(args) == 0
    assert "2928 tokens and 5 tower passes each" in capsys.readouterr().out


def test_a_cpu_plan_prices_the_front_ends_stall_and_says_so(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--device cpu`` prices placement.front_end_ms_per_token's default into instances on several threads,
    pipeline-parallel ones included in the search (they pay none: pp > 1 is planned without it); GPU plans
    price none unless asked."""
    assert main([*BASE, "--model", str(tiny_dir), "--json", "--device", "cpu"]) == 0
    cpu = json.loads(capsys.readouterr().out)
    assert cpu["front_end_ms_per_token"] == pytest.approx(0.35)
    assert main([*BASE, "--model", str(tiny_dir), "--json"]) == 0
    gpu = json.loads(capsys.readouterr().out)
    assert gpu["front_end_ms_per_token"] == 0
    assert cpu["colocated_per_gpu_goodput"] <= gpu["colocated_per_gpu_goodput"]
    assert main([*BASE, "--model", str(tiny_dir), "--front-end-ms-per-token", "0.5"]) == 0
    assert "Front end: 0.5 ms of CPU per streamed token" in capsys.readouterr().out


def test_a_cpu_plan_counts_this_machines_cores_and_calls_them_cores(tiny_dir: Path, capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --gpus-per-node, --device cpu plans on this machine's usable cores (at most the planner's 64; a GPU
    plan on 8 GPUs), and the text names the devices cores."""
    from mm_serve.planner.auto_placement import usable_cores

    args = ["plan", "--slo-ttft", "0.25", "--slo-tpot", "0.1", "--hardware", "h100-80gb", "--model", str(tiny_dir)]
    assert main([*args, "--json", "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["gpus_per_node"] == len(usable_cores())
    monkeypatch.setattr("mm_serve.planner.auto_placement.usable_cores", lambda: list(range(96)))
    assert main([*args, "--json", "--device", "cpu"]) == 0  # a 96-core machine: the planner's bound, not an error
    assert json.loads(capsys.readouterr().out)["gpus_per_node"] == 64
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpus_per_node"] == 8
    assert main([*args, "--device", "cpu", "--gpus-per-node", "2"]) == 0
    text = capsys.readouterr().out
    assert " = 2 cores, " in text and "req/s/core" in text and "core ids" in text and "GPU" not in text
