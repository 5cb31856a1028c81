"""``mm-serve profile`` measures our engine and writes a file the planner fits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mm_serve.cli.main import main
from mm_serve.planner.profile_file import load_profile


def test_profile_writes_a_file_the_planner_loads(tiny_llava: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "profile.json"
    code = main(["profile", "--model", str(tiny_llava), "--out", str(out), "--prefill-tokens", "16,64",
                 "--decode-batches", "1,2", "--decode-contexts", "32", "--repeats", "1"])
    assert code == 0
    data = json.loads(out.read_text())
    assert [r["tokens"] for r in data["prefill"]] == [16, 64]
    assert [(r["batch"], r["context"]) for r in data["decode"]] == [(1, 32), (2, 32)]
    assert all(r["seconds"] > 0 for r in data["prefill"] + data["decode"] + data["encode"])
    profile = load_profile(out)
    assert len(profile.prefill) == 2 and len(profile.decode) == 2 and len(profile.encode) == 2
    assert "wrote" in capsys.readouterr().out


def test_profile_rejects_bad_sizes(tiny_llava: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--model", str(tiny_llava), "--out", str(tmp_path / "p.json"),
                 "--prefill-tokens", "a,b"]) == 2
    assert "--prefill-tokens must be comma-separated integers" in capsys.readouterr().err
