"""``mm-serve profile`` measures our engine and writes a file the planner fits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mm_serve.cli.main import main
from mm_serve.planner.auto_placement import usable_cores
from mm_serve.planner.profile_file import load_profile


def test_profile_writes_a_file_the_planner_loads(tiny_llava: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "profile.json"
    code = main(["profile", "--model", str(tiny_llava), "--out", str(out), "--prefill-tokens", "16,64",
                 "--decode-batches", "1,2", "--decode-contexts", "32", "--repeats", "1", "--parallel-threads", "2"])
    assert code == 0
    data = json.loads(out.read_text())
    assert [r["tokens"] for r in data["prefill"]] == [16, 64]
    assert [(r["batch"], r["context"]) for r in data["decode"]] == [(1, 32), (2, 32)]
    assert all(r["seconds"] > 0 for r in data["prefill"] + data["decode"] + data["encode"])
    profile = load_profile(out)
    assert len(profile.prefill) == 2 and len(profile.decode) == 2 and len(profile.encode) == 2
    [two] = profile.tensor_parallel  # the same sizes again on two threads
    assert two.degree == 2 and [p.tokens for p in two.prefill] == [16, 64] and len(two.decode) == 2
    assert len(two.encode) == 2
    printed = capsys.readouterr().out
    assert "wrote" in printed and "[2 threads] decode  batch=  2 context=   32" in printed
    # each size on both thread counts before the next size (a slowdown while profiling falls on both)
    timed = [line.split(" ms")[0].rsplit(None, 1)[0] for line in printed.splitlines() if line.endswith(" ms")]
    assert timed[:4] == ["prefill tokens=   16", "[2 threads] prefill tokens=   16",
                         "prefill tokens=   64", "[2 threads] prefill tokens=   64"]
    assert timed[4:8] == ["decode  batch=  1 context=   32", "[2 threads] decode  batch=  1 context=   32",
                          "decode  batch=  2 context=   32", "[2 threads] decode  batch=  2 context=   32"]


def test_profile_rejects_bad_sizes(tiny_llava: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--model", str(tiny_llava), "--out", str(tmp_path / "p.json"),
                 "--prefill-tokens", "a,b"]) == 2
    assert "--prefill-tokens must be comma-separated integers" in capsys.readouterr().err
    assert main(["profile", "--model", str(tiny_llava), "--out", str(tmp_path / "p.json"), "--threads", "2",
                 "--parallel-threads", "2"]) == 2
    assert "--parallel-threads needs --threads 1 (each count is an instance of that many cores), got --threads 2" \
        in capsys.readouterr().err
    for counts in ("1,2", "4096"):
        assert main(["profile", "--model", str(tiny_llava), "--out", str(tmp_path / "p.json"),
                     "--parallel-threads", counts]) == 2
        assert f"--parallel-threads counts must be between 2 and the {len(usable_cores())} usable cores, " \
            f"got '{counts}'" in capsys.readouterr().err


def test_profile_default_sizes_fit_the_embedded_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The default sizes (up to 1024 tokens) are capped to the default (embedded) model's 512-token
    context, with a note, instead of failing; sizes given explicitly past it stay an error naming the flag."""
    out = tmp_path / "profile.json"
    assert main(["profile", "--out", str(out), "--repeats", "1",
                 "--decode-batches", "1,2"]) == 0
    data = json.loads(out.read_text())
    assert [r["tokens"] for r in data["prefill"]] == [32, 128, 511]
    assert [(r["batch"], r["context"]) for r in data["decode"]] == [(1, 128), (1, 511), (2, 128), (2, 511)]
    err = capsys.readouterr().err
    assert "mm-serve profile: the model's context is 512 tokens: default --prefill-tokens 512,1024 -> 511; " \
        "--decode-contexts 512 -> 511" in err
    assert len(load_profile(out).prefill) == 3
    assert main(["profile", "--model", "embedded", "--out", str(tmp_path / "p.json"),
                 "--prefill-tokens", "32,512"]) == 2
    assert "sizes exceed the model's context length (512 tokens): --prefill-tokens 512 (at most 511" \
        in capsys.readouterr().err


def test_a_bad_checkpoint_or_out_is_one_line_before_any_measuring(
        tiny_llava: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    opt = tmp_path / "opt"
    opt.mkdir()
    (opt / "config.json").write_text(json.dumps({"architectures": ["OPTForCausalLM"], "model_type": "opt"}))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tiny_llava / "config.json").read_text())
    for model, expected in ((opt, "OPTForCausalLM"), (no_weights, "safetensors")):
        assert main(["profile", "--model", str(model), "--out", str(tmp_path / "p.json")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("mm-serve: error: ") and expected in err and "Traceback" not in err
    for out, expected in ((tmp_path, "is a folder"), (Path("/proc/nope/p.json"), "cannot create its folder"),
                          (Path("/proc/p.json"), "not writable")):
        assert main(["profile", "--model", str(tiny_llava), "--out", str(out)]) == 2
        captured = capsys.readouterr()
        assert f"--out {out}: {expected}" in captured.err and "prefill" not in captured.out  # nothing measured


def test_a_profile_measured_beside_a_busy_process_says_so(tiny_llava: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A process spinning on one of the cores while the profile measures: a warning on stderr, and the
    share in the file (``measured_under_load``, what a server start reads as "measure again").
    ``memory_bytes`` is this machine's memory."""
    import subprocess
    import sys
    import time

    from mm_serve.cluster.host_memory import total_bytes

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # running before the measuring starts
        out = tmp_path / "busy.json"
        assert main(["profile", "--model", str(tiny_llava), "--out", str(out), "--prefill-tokens", "16,64",
                     "--decode-batches", "1,2", "--decode-contexts", "32", "--repeats", "3"]) == 0
    finally:
        spinner.kill()
        spinner.wait()
    data = json.loads(out.read_text())
    share = data["measured_under_load"]
    assert 0.2 < share <= 1.0
    assert f"other processes kept {share:.0%} of this process's cores busy while it measured" in capsys.readouterr().err
    assert data["memory_bytes"] == total_bytes() and data["memory_bytes"] > 2**30
    load_profile(out)  # still a profile the planner reads
