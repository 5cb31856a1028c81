"""MM_SERVE_STEP_LOG: one JSON line per timed worker step, from every worker of a real server; a path
that cannot be opened leaves the worker serving without it, said on the serve console at start."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from mm_serve.runtime.messages import StepTiming
from mm_serve.runtime.step_log import STEP_LOG_ENV, StepLog, step_log_problem
from tests.api.server_process import ServerProcess


def test_a_step_log_line_holds_the_role_the_index_and_the_step_timing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(STEP_LOG_ENV, str(path))
    log = StepLog.from_env("decode", 3)
    assert log is not None
    log.write(StepTiming("decode", 0.0125, 4, 2048, 0, 0.011))
    log.write(StepTiming("prefill", 0.25, 2, 700, 1, 0.24, 3, 1500))
    log.close()
    log.close()  # twice: nothing
    log.write(StepTiming("decode", 0.01, 1, 10))  # closed: nothing written
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert {k: v for k, v in first.items() if k != "time"} == {
        "role": "decode", "index": 3, "kind": "decode", "seconds": 0.0125, "requests": 4, "tokens": 2048,
        "images": 0, "cpu_seconds": 0.011, "decode_requests": 0, "decode_context": 0}
    assert (second["kind"], second["images"], second["decode_requests"], second["decode_context"]) == ("prefill", 1, 3, 1500)
    assert 0 <= second["time"] - first["time"] < 5


def test_no_log_unless_the_variable_names_a_file_that_opens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(STEP_LOG_ENV, raising=False)
    assert StepLog.from_env("prefill", 0) is None
    monkeypatch.setenv(STEP_LOG_ENV, "")
    assert StepLog.from_env("prefill", 0) is None
    monkeypatch.setenv(STEP_LOG_ENV, str(tmp_path))  # a folder
    assert StepLog.from_env("prefill", 0) is None
    said = capsys.readouterr()
    assert f"[prefill 0] {STEP_LOG_ENV}={tmp_path}: cannot open" in said.out + said.err


def test_every_worker_of_a_server_logs_its_timed_steps(tiny_llama: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """1 prefill + 1 decode worker: the prefill worker's batch holds the prompt's tokens, and each decode
    step's context lies between the prompt and the prompt plus the answer."""
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(STEP_LOG_ENV, str(path))
    proc = ServerProcess(tiny_llama, log_dir=tmp_path)
    try:
        proc.wait_ready()
        r = httpx.post(f"{proc.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "one two three four five", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
    finally:
        assert proc.stop() == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    prefill = [row for row in rows if row["role"] == "prefill"]
    decode = [row for row in rows if row["role"] == "decode"]
    assert {row["index"] for row in rows} == {0} and {row["role"] for row in rows} == {"prefill", "decode"}
    served = [row for row in prefill if row["tokens"] == usage["prompt_tokens"]]  # (warm-up passes are not reported)
    assert len(served) == 1 and served[0]["kind"] == "prefill" and served[0]["requests"] == 1
    assert decode and all(row["kind"] == "decode" and row["requests"] == 1 for row in decode)
    last = usage["prompt_tokens"] + usage["completion_tokens"]
    assert all(usage["prompt_tokens"] <= row["tokens"] <= last for row in decode)
    assert len(decode) <= usage["completion_tokens"] - 1


def test_a_failed_write_closes_the_log_and_says_so_once(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """/dev/full: every write fails with ENOSPC, as on a full disk; the worker goes on without the log."""
    monkeypatch.setenv(STEP_LOG_ENV, "/dev/full")
    log = StepLog.from_env("colocated", 0)
    assert log is not None
    for _ in range(3):
        log.write(StepTiming("decode", 0.01, 1, 10))
    said = capsys.readouterr()
    assert (said.out + said.err).count(f"[colocated 0] {STEP_LOG_ENV}: write failed (No space left on device); step log closed") == 1


def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A named pipe with no reader would hold the worker's start in open(); it is refused instead."""
    import os

    fifo = tmp_path / "steps.fifo"
    os.mkfifo(fifo)
    monkeypatch.setenv(STEP_LOG_ENV, str(fifo))
    assert StepLog.from_env("decode", 1) is None
    said = capsys.readouterr()
    assert f"[decode 1] {STEP_LOG_ENV}={fifo}: cannot open" in said.out + said.err


def test_the_front_end_says_why_a_step_log_cannot_be_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.delenv(STEP_LOG_ENV, raising=False)
    assert step_log_problem() is None
    usable = tmp_path / "steps.jsonl"
    monkeypatch.setenv(STEP_LOG_ENV, str(usable))
    assert step_log_problem() is None and usable.is_file() and usable.read_bytes() == b""  # created, nothing written
    missing = tmp_path / "no" / "steps.jsonl"
    monkeypatch.setenv(STEP_LOG_ENV, str(missing))
    assert step_log_problem() == (f"{STEP_LOG_ENV}={missing}: cannot open (No such file or directory); "
                                  "the workers serve without a step log")
    fifo = tmp_path / "steps.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # with a reader the FIFO opens, and is refused as one
    try:
        monkeypatch.setenv(STEP_LOG_ENV, str(fifo))
        assert step_log_problem() == (f"{STEP_LOG_ENV}={fifo}: not a regular file or a device; "
                                      "the workers serve without a step log")
    finally:
        os.close(reader)


def test_a_folder_as_step_log_is_a_warning_on_the_serve_console(tiny_llama: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers' own notice goes to their log files; the user sees the front end's, and the service serves."""
    monkeypatch.setenv(STEP_LOG_ENV, str(tmp_path))
    proc = ServerProcess(tiny_llama, log_dir=tmp_path)
    try:
        proc.wait_ready()
        r = httpx.post(f"{proc.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "one two", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
    finally:
        assert proc.stop() == 0
    assert (f"mm-serve: warning: {STEP_LOG_ENV}={tmp_path}: cannot open (Is a directory); the workers serve "
            "without a step log") in proc.output()
