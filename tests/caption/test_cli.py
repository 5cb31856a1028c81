"""``mm-serve caption`` usage errors: exit status 2 and one line, before any engine starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mm_serve.cli.main import main


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = main(["caption", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("mm-serve: error: ") and len(err.splitlines()) == 1
    return err


def test_usage_errors_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "out.jsonl")
    assert "no such file or folder" in _error(capsys, str(tmp_path / "missing"), "--out", out)
    assert "no images or videos found" in _error(capsys, str(tmp_path), "--out", out)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "a", "image": "a.png"}\n{"id": "a", "image": "b.png"}\n')
    assert "duplicate id 'a'" in _error(capsys, str(dup), "--out", out)
    assert "--concurrency must be at least 1" in _error(capsys, str(dup), "--out", out, "--concurrency", "0")
    assert "--max-tokens must be at least 1" in _error(capsys, str(dup), "--out", out, "--max-tokens", "0")
    assert "cannot be used with --server" in _error(
        capsys, str(dup), "--out", out, "--server", "http://127.0.0.1:9", "--config", "x.yaml")
    assert "--out is the INPUT file" in _error(capsys, str(dup), "--out", str(dup))
    assert "--server must be an http(s) URL" in _error(capsys, str(dup), "--out", out, "--server", "not-a-url")
    (tmp_path / "one.png").write_bytes(b"x")
    assert "not one image" in _error(capsys, str(tmp_path / "one.png"), "--out", out)


def test_checkpoint_without_a_tokenizer_exits_2(tmp_path: Path, tiny_llava: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "no-tokenizer"
    broken.mkdir()
    for name in ("config.json", "model.safetensors", "preprocessor_config.json"):
        (broken / name).write_bytes((tiny_llava / name).read_bytes())
    (tmp_path / "img").mkdir()
    (tmp_path / "img/a.png").write_bytes(b"x")
    code = main(["caption", str(tmp_path / "img"), "--out", str(tmp_path / "o.jsonl"), "--model", str(broken)])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("mm-serve: error: ") and "cannot load the tokenizer" in last


def test_unusable_output_or_model_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "img").mkdir()
    (tmp_path / "img/a.png").write_bytes(b"x")
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": "a.png", "caption": "x"}) + "\n{torn\n" + json.dumps({"id": "b"}) + "\n")
    assert "out.jsonl:2: not valid JSON" in _error(capsys, str(tmp_path / "img"), "--out", str(out))
    fresh = str(tmp_path / "fresh.jsonl")
    assert "neither a registered name" in _error(capsys, str(tmp_path / "img"), "--out", fresh,
                                                 "--model", str(tmp_path / "no-model"))


def test_model_and_server_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["caption", "in", "--out", "o", "--model", "m", "--server", "http://x"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_nothing_to_do_starts_no_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "img").mkdir()
    (tmp_path / "img/a.png").write_bytes(b"x")
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": "a.png", "path": "p", "error": "bad"}) + "\n")
    assert main(["caption", str(tmp_path / "img"), "--out", str(out), "--model", "/no/such/model"]) == 0
    assert "0 succeeded, 0 failed, 1 already done, 0 remaining (of 1)" in capsys.readouterr().out


def test_failed_start_leaves_no_empty_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "img").mkdir()
    (tmp_path / "img/a.png").write_bytes(b"x")
    bad = tmp_path / "bad.yaml"
    bad.write_text("cpu_gemm: blas\n")
    out = tmp_path / "out.jsonl"

    def bad_config() -> str:
        code = main(["caption", str(tmp_path / "img"), "--out", str(out), "--config", str(bad)])
        err = capsys.readouterr().err
        assert code == 2
        return err

    assert "cpu_gemm = 'blas'" in bad_config()
    # An unreachable server is a service that failed to start (exit 1), not a usage error.
    code = main(["caption", str(tmp_path / "img"), "--out", str(out), "--server", "http://127.0.0.1:9", "--retries", "0"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("mm-serve: error: --server http://127.0.0.1:9: ") and "cannot reach" in err
    assert not out.exists()
    out.write_text("")  # an OUT that was there before the run is left alone
    assert "cpu_gemm = 'blas'" in bad_config()
    assert out.exists()


def test_dangling_symlink_out_is_left_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "img").mkdir()
    (tmp_path / "img/a.png").write_bytes(b"x")
    bad = tmp_path / "bad.yaml"
    bad.write_text("cpu_gemm: blas\n")
    (tmp_path / "data").mkdir()
    link = tmp_path / "link.jsonl"
    link.symlink_to(tmp_path / "data" / "results.jsonl")
    assert main(["caption", str(tmp_path / "img"), "--out", str(link), "--config", str(bad)]) == 2
    assert "cpu_gemm = 'blas'" in capsys.readouterr().err
    assert link.is_symlink()


@pytest.mark.parametrize(("name", "text", "what"), [
    ("tokenizer.json", "[" * 100_000, "cannot load the tokenizer"),
    ("preprocessor_config.json", "{bad", "cannot load the image processor"),
    ("chat_template.jinja", "{% for m in messages %}{{ m.content }", "the chat template is not valid Jinja (line 1"),
])
def test_a_checkpoint_file_that_is_not_json_exits_2(tmp_path: Path, tiny_llava: Path, capsys: pytest.CaptureFixture[str],
                                                    name: str, text: str, what: str) -> None:
    """A tokenizer nested past the recursion limit, a preprocessor config that is not JSON, a chat template
    that does not compile: a CLI error naming the part (they were a traceback and exit 1; the template, a
    start that failed every chat call)."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in tiny_llava.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    (broken / name).write_text(text)
    (tmp_path / "img").mkdir()
    (tmp_path / "img/a.png").write_bytes(b"x")
    code = main(["caption", str(tmp_path / "img"), "--out", str(tmp_path / "o.jsonl"), "--model", str(broken)])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("mm-serve: error: ") and what in last


def test_a_setting_without_effect_is_warned_about(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As ``mm-serve serve`` does: decode_pacing_always without any pacing is named before the start (which
    then fails here on a model that does not exist)."""
    (tmp_path / "img").mkdir()
    (tmp_path / "img/a.png").write_bytes(b"x")
    config = tmp_path / "c.yaml"
    config.write_text("model: /no/such/model\nscheduler:\n  decode_pacing_always: true\n")
    assert main(["caption", str(tmp_path / "img"), "--out", str(tmp_path / "o.jsonl"), "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "mm-serve caption: warning: scheduler.decode_pacing_always has no effect" in err
    assert err.strip().splitlines()[-1].startswith("mm-serve: error: ")
