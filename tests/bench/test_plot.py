"""`python -m mm_serve.bench.plot`: merging bench JSON files into one PNG, and its usage errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mm_serve.bench.plot import main


def _doc(name: str, rates: list[float], attainments: list[float]) -> dict[str, object]:
    runs = [{"rate": r, "attainment": a, "stopped_early": False} for r, a in zip(rates, attainments, strict=True)]
    return {"slo": {"attainment_target": 0.9}, "systems": [{"name": name, "goodput": rates[0], "sweep": {"runs": runs}}]}


def test_two_files_make_one_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_doc("ours", [1.0, 2.0], [1.0, 0.5])))
    b.write_text(json.dumps(_doc("vllm", [1.0, 2.0], [0.95, 0.2])))
    out = tmp_path / "fig" / "goodput.png"
    assert main([str(a), str(b), "--out", str(out), "--title", "chatbot"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert capsys.readouterr().out.strip() == str(out)


@pytest.mark.parametrize(("content", "says"), [
    (None, "cannot read"),
    ("{not json", "not JSON"),
    ("[1, 2]", "a JSON list"),
    ('{"systems": [{"sweep": {"runs": [{"attainment": 0.5}]}}]}', "not an `mm-serve bench --out` result"),
    ('{"systems": []}', "no system in these files has a measured run"),
    ('{"a": 1}', "no 'systems' list"),
    ("[" * 100_000, "not JSON (RecursionError"),
    ('{"systems": [{"name": "a", "goodput": "x", "single": {"rate": 1, "attainment": 1}}]}', "goodput 'x' is not a number"),
    ('{"systems": [{"name": "a", "single": {"rate": 0, "attainment": 1}}]}', "rate 0 is out of range"),
    ('{"systems": [{"name": "a", "single": {"rate": 1e400, "attainment": 1}}]}', "out of range"),
    ('{"systems": [{"name": "a", "single": {"rate": ' + "9" * 401 + ', "attainment": 1}}]}', "OverflowError"),
    ('{"systems": [{"name": "a", "single": {"rate": 1, "attainment": 1.5}}]}', "attainment 1.5 is out of range"),
])
def test_unusable_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        content: str | None, says: str) -> None:
    path = tmp_path / "bench.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        main([str(path), "--out", str(tmp_path / "out.png")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert not (tmp_path / "out.png").exists()


def test_unwritable_out_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_doc("ours", [1.0], [1.0])))
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main([str(path), "--out", str(tmp_path / "file" / "out.png")])
    assert exit_info.value.code == 2
    assert "cannot write" in capsys.readouterr().err


@pytest.mark.parametrize(("out", "says"), [
    ("folder", "is a folder; give the figure's file name"),
    ("noext", "give a file name ending in an image format (.png, .pdf, .svg, ...), not no suffix"),
    ("fig.xyz", "not .xyz"),
])
def test_an_out_that_is_no_image_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       out: str, says: str) -> None:
    """An --out that is a folder, has no suffix (matplotlib writes ``NAME.png`` beside such a name) or has a
    suffix that is no image format is refused, and nothing is written."""
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_doc("ours", [1.0], [1.0])))
    (tmp_path / "folder").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main([str(path), "--out", str(tmp_path / out)])
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "folder"]


def test_dollar_signs_are_drawn_as_written(tmp_path: Path) -> None:
    """A title or system name with ``$`` is drawn as text, not parsed as TeX by matplotlib's mathtext (whose parser raises on ``$\\foo$``)."""
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_doc("a $x^$ b", [1.0, 2.0], [1.0, 0.5])))
    assert main([str(path), "--out", str(tmp_path / "f.png"), "--title", "$\\foo$"]) == 0
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(SystemExit):
        main([str(fifo), "--out", str(tmp_path / "f.png")])
    assert "not a regular file" in capsys.readouterr().err
