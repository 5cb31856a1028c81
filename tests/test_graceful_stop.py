"""SIGTERM to the whole process group drains: in-flight requests finish, new ones get 503, nothing is left."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from mm_serve.cluster.stale_instances import SHM_DIR, process_start_time
from tests.api.server_process import free_port, worker_children

LONG = 1000  # tokens per in-flight request
STEP_MS = 5  # the decode worker starts a step at most every STEP_MS ms: a LONG request decodes >= 5 s
# (unpaced, a fast CPU decoded 3000 tokens of the tiny model in 1.5 s: the streams had ended before the
# signal's effects were looked at)
PACED = f"scheduler:\n  decode_step_interval_ms: {STEP_MS}\n  decode_pacing_always: true\n"


def _stream(url: str, out: list[str], errors: list[str]) -> None:
    """A chat stream of LONG tokens: appends its finish reason to ``out`` (or what it raised to ``errors``)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me"}], "max_tokens": LONG,
            "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        out.append(next(c["choices"][0]["finish_reason"] for c in reversed(chunks) if c["choices"]))
    except Exception as exc:  # recorded, asserted below
        errors.append(repr(exc))


@pytest.fixture(scope="module")
def paced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config file that paces decode steps (PACED)."""
    path = tmp_path_factory.mktemp("paced") / "paced.yaml"
    path.write_text(PACED)
    return path


def _serve(tiny_llava: Path, config: Path, log: Path | None, grace_s: int,
           new_session: bool = False) -> tuple[subprocess.Popen[bytes], str]:
    """``mm-serve serve --config config`` of the tiny model on a free port with ``--shutdown-grace-s
    grace_s``, its output in ``log`` (None: a pipe, ``proc.stdout``; ``new_session``: in a process group of
    its own); returns the process and its URL."""
    port = free_port()
    with open(log or os.devnull, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mm_serve.cli.main", "serve", "--model", str(tiny_llava), "--port", str(port),
             "--served-model-name", "tiny", "--shutdown-grace-s", str(grace_s), "--no-auto-placement",
             "--config", str(config)],
            stdout=out if log else subprocess.PIPE, stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"}, start_new_session=new_session)
    return proc, f"http://127.0.0.1:{port}"


def test_sigterm_after_the_reader_of_the_output_left_still_stops(tiny_llava: Path, paced: Path) -> None:
    """``mm-serve serve 2>&1 | head`` once head has exited: the drain's message meets a closed pipe
    (EPIPE). The server still drains and exits 0, stopping its workers; a BrokenPipeError out of the
    signal handler had left it running, ignoring SIGTERM."""
    proc, url = _serve(tiny_llava, paced, None, 60, new_session=True)
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line.decode())
            if "is ready" in seen[-1]:
                break
        assert "is ready" in seen[-1], "".join(seen)
        workers = worker_children(proc.pid)
        assert len(workers) == 2
        proc.stdout.close()  # the reader leaves
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        _kill_group(proc)
    time.sleep(0.5)
    assert all(process_start_time(pid) is None for pid in workers)


def test_sigterm_to_the_process_group_drains_then_leaves_nothing(tiny_llava: Path, paced: Path, tmp_path: Path) -> None:
    """In-flight streams complete with finish_reason 'length'; a request during the drain gets 503;
    the server exits 0 with its last message (uvicorn re-raises the signal after a graceful stop,
    which made it exit 143, killed by SIGTERM); afterwards no worker process, segment or run
    directory of the instance is left. It runs on uvloop (``api.event_loop: auto``)."""
    log = tmp_path / "server.log"
    before = {p.name.split("-")[1] for p in SHM_DIR.glob("mmsrv-*")}
    # its own process group, as under systemd or a container runtime
    proc, url = _serve(tiny_llava, paced, log, 60, new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        workers = [int(w["pid"]) for w in httpx.get(f"{url}/internal/stats", timeout=5).json().values()]
        mine = {p.name.split("-")[1] for p in SHM_DIR.glob("mmsrv-*")} - before
        assert len(mine) == 1 and len(workers) == 2
        loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"  # a dependency but on Windows
        assert httpx.get(f"{url}/health", timeout=5).json()["event_loop"] == loop
        finished: list[str] = []
        errors: list[str] = []
        threads = [threading.Thread(target=_stream, args=(url, finished, errors)) for _ in range(3)]
        for t in threads:
            t.start()
        _wait_decoding(url, 3)
        os.killpg(proc.pid, signal.SIGTERM)
        time.sleep(0.5)
        refused = httpx.post(f"{url}/v1/chat/completions", timeout=10, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert int(refused.headers["retry-after"]) >= 1  # a replacement may answer once the grace is over
        assert "media" not in refused.headers["server-timing"]  # refused before any input processing
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "stopping"
        assert 1 <= int(health.headers["retry-after"]) <= 60  # what is left of the grace
        for t in threads:
            t.join(120)
        assert errors == [] and finished == ["length"] * 3
        assert proc.wait(60) == 0, log.read_text()[-2000:]
    finally:
        _kill_group(proc)
    time.sleep(0.5)
    assert all(process_start_time(pid) is None for pid in workers), log.read_text()[-2000:]
    (instance,) = mine
    assert not list(SHM_DIR.glob(f"mmsrv-{instance}-*"))
    assert not list(Path(tempfile.gettempdir()).glob(f"mmsrv-{instance}-*"))
    assert "stopping: new requests get 503" in log.read_text()
    assert "mm-serve: stopped (workers and shared memory released)" in log.read_text()


def _wait_decoding(url: str, requests: int) -> None:
    """Wait (up to 60 s) until the decode worker runs ``requests`` requests."""
    deadline = time.monotonic() + 60
    running = 0
    while running < requests and time.monotonic() < deadline:
        running = httpx.get(f"{url}/internal/stats", timeout=10).json()["decode0"]["running"]
        time.sleep(0.05)
    assert running == requests


def _stream_events(url: str, out: list[list[str]]) -> None:
    body = {"model": "tiny", "prompt": "Tell me", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        out.append([line for line in r.iter_lines() if line.startswith("data: ")])


@pytest.mark.parametrize("signals", [2, 3])
def test_a_second_signal_answers_calls_in_flight_with_json_503(tiny_llava: Path, paced: Path, tmp_path: Path, signals: int) -> None:
    """A second SIGINT stops at once: a call still decoding gets 503 ``service_unavailable`` in OpenAI's
    error JSON with Retry-After (uvicorn sent a plain-text 500 from the cancelled task), a stream ends with
    that error as its last event, then ``[DONE]`` (it was cut, with a traceback per stream in the log), and
    nothing of the instance is left. A third signal 50 ms later (exit without waiting for the answers)
    changes none of that, and logs no traceback (the app's lifespan task was cancelled by the loop's
    teardown)."""
    log = tmp_path / "server.log"
    proc, url = _serve(tiny_llava, paced, log, 60)
    answers: list[httpx.Response] = []
    streams: list[list[str]] = []
    try:
        deadline = time.monotonic() + 180
        while "is ready" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = [int(w["pid"]) for w in httpx.get(f"{url}/internal/stats", timeout=5).json().values()]
        call = threading.Thread(target=lambda: answers.append(httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "Tell me", "max_tokens": LONG, "n": 4, "ignore_eos": True})))
        stream = threading.Thread(target=_stream_events, args=(url, streams))
        call.start()
        stream.start()
        _wait_decoding(url, 5)  # the call's 4 choices and the stream
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert call.is_alive() and stream.is_alive()  # draining: both are still decoding
        proc.send_signal(signal.SIGINT)
        if signals == 3:
            time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
        call.join(60)
        stream.join(60)
        assert proc.wait(60) == 0, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (answer,) = answers
    assert answer.status_code == 503 and answer.headers["content-type"] == "application/json", answer.text
    assert answer.json()["error"]["code"] == "service_unavailable" and int(answer.headers["retry-after"]) >= 1
    (events,) = streams
    assert len(events) > 3 and json.loads(events[1][6:])["choices"][0]["text"]  # tokens came before the stop
    assert json.loads(events[-2][6:])["error"]["code"] == "service_unavailable" and events[-1] == "data: [DONE]"
    text = log.read_text()
    assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]
    assert "5 request(s) still in flight on a second signal" in text  # the call's n=4 choices and the stream
    time.sleep(0.5)
    assert all(process_start_time(pid) is None for pid in workers), log.read_text()[-2000:]


def test_without_a_grace_the_first_signal_answers_streams_in_flight(tiny_llava: Path, paced: Path, tmp_path: Path) -> None:
    """``--shutdown-grace-s 0``: the first SIGINT stops at once, and a stream in flight still ends with a
    ``service_unavailable`` error event and ``[DONE]`` (it was held until uvicorn's 5 s wait for connections
    ran out, then cut), with no traceback."""
    log = tmp_path / "server.log"
    proc, url = _serve(tiny_llava, paced, log, 0)
    streams: list[list[str]] = []
    try:
        deadline = time.monotonic() + 180
        while "is ready" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        stream = threading.Thread(target=_stream_events, args=(url, streams))
        stream.start()
        _wait_decoding(url, 1)
        stopped = time.monotonic()
        proc.send_signal(signal.SIGINT)
        stream.join(60)
        assert proc.wait(60) == 0, log.read_text()[-2000:]
        assert time.monotonic() - stopped < 4.0  # not uvicorn's 5 s wait for the stream's connection
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (events,) = streams
    assert json.loads(events[-2][6:])["error"]["code"] == "service_unavailable" and events[-1] == "data: [DONE]"
    text = log.read_text()
    assert "Traceback" not in text and "1 request(s) still in flight (no grace); stopping them" in text, text[-3000:]


def test_sigterm_while_the_front_end_still_loads_stops_the_workers_it_started(tiny_llava: Path, paced: Path, tmp_path: Path) -> None:
    """The workers start before the front end has loaded its tokenizer and app (the two overlap): a
    SIGTERM to the process group in that window stops the start as Ctrl-C does (exit 130, "interrupted"),
    and leaves no worker process, segment or run directory. (SIGTERM's default would kill the front end
    at once, leaving its workers to notice it gone and its segments to the next start.)"""
    log = tmp_path / "server.log"
    before = {p.name.split("-")[1] for p in SHM_DIR.glob("mmsrv-*")}
    run_dirs = set(Path(tempfile.gettempdir()).glob("mmsrv-*"))
    proc, _ = _serve(tiny_llava, paced, log, 60, new_session=True)
    try:
        deadline = time.monotonic() + 60
        workers: list[int] = []
        while len(workers) < 2 and time.monotonic() < deadline and proc.poll() is None:
            workers = worker_children(proc.pid)
            time.sleep(0.01)
        assert len(workers) == 2, log.read_text()
        assert "is ready" not in log.read_text()
        _sigterm_exits(proc, 130, log)
    finally:
        _kill_group(proc)
    assert "mm-serve: interrupted" in log.read_text()
    time.sleep(0.5)
    assert all(process_start_time(pid) is None for pid in workers), log.read_text()[-2000:]
    mine = {p.name.split("-")[1] for p in SHM_DIR.glob("mmsrv-*")} - before
    assert mine == set()
    assert set(Path(tempfile.gettempdir()).glob("mmsrv-*")) <= run_dirs


def test_sigterm_while_the_workers_load_behind_a_running_front_end_exits_130(tiny_llava: Path, tmp_path: Path) -> None:
    """The front end answers (``/health`` 503) while the workers' start waits on a CPU kernel build (a
    compiler that never returns): a SIGTERM then stops the start, exit 130 as before uvicorn ran (it was
    0, with no banner, as if the service had stopped after serving), and the build is stopped too."""
    hung = tmp_path / "hung-cxx"
    hung.write_text("#!/bin/sh\nexec sleep 987.654\n")  # a length no other process sleeps
    hung.chmod(0o755)
    port = free_port()
    log = tmp_path / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CXX": str(hung), "MM_SERVE_CACHE_DIR": str(tmp_path / "cache")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mm_serve.cli.main", "serve", "--model", str(tiny_llava), "--port", str(port),
             "--no-auto-placement"], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        status = 0
        while status != 503 and time.monotonic() < deadline and proc.poll() is None:
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code
            except httpx.HTTPError:
                time.sleep(0.1)
        assert status == 503, log.read_text()
        _sigterm_exits(proc, 130, log)
    finally:
        _kill_group(proc)
    text = log.read_text()
    assert "interrupted before the workers were ready" in text and "is ready" not in text
    time.sleep(0.5)
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p) == "sleep 987.654 "]


def _sigterm_exits(proc: subprocess.Popen[bytes], status: int, log: Path) -> None:
    """SIGTERM to ``proc``'s process group; it exits with ``status`` within 60 s."""
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(60) == status, log.read_text()[-2000:]


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``'s process group if it still runs (a failed test leaves nothing behind)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _cmdline(proc_dir: Path) -> str:
    try:
        return (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


_SIGNAL_IN_EXEC = '''
import os, signal, sys
from mm_serve.cli import main as cli

signal.signal(signal.SIGTERM, cli.stop_on_signal if sys.argv[1] == "stop_on_signal" else signal.default_int_handler)
try:  # the handler runs inside code exec() runs from a string, as when a signal lands in a dataclass's build
    exec("import os, signal\\nos.kill(os.getpid(), signal.SIGTERM)\\nfor _ in range(10**7): pass")
except KeyboardInterrupt:
    print("caught")
sys.exit(130)
'''


@pytest.mark.parametrize(("handler", "status"), [("stop_on_signal", 130), ("default_int_handler", -signal.SIGINT)])
def test_a_signal_caught_inside_exec_code_exits_with_the_status_main_returns(tmp_path: Path, handler: str,
                                                                            status: int) -> None:
    """Run as ``python -m`` (as the tests start the server), a bare KeyboardInterrupt that left exec()'d
    code makes CPython kill the process with SIGINT at exit even though it was caught (the second case:
    the cause of an intermittent -2 in place of 130 when SIGTERM hit a start); the CLI's StopSignal does
    not, so the process exits 130."""
    (tmp_path / "signal_in_exec.py").write_text(_SIGNAL_IN_EXEC)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "signal_in_exec", handler], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout == "caught\n", done.stderr
    assert done.returncode == status


def test_an_interrupt_a_library_turned_into_its_own_error_exits_130(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """SIGTERM landing inside transformers' lazy import leaves as its ``ModuleNotFoundError`` (the interrupt
    as its context): the CLI exits 130, "interrupted", with no traceback; an error not caused by an
    interrupt still propagates."""
    import argparse

    from mm_serve.cli import main as cli

    def rewrapped(_: argparse.Namespace) -> int:
        try:
            raise cli.StopSignal
        except KeyboardInterrupt:
            raise ModuleNotFoundError("Could not import module 'LlamaConfig'") from None  # context kept

    def plain(_: argparse.Namespace) -> int:
        raise ModuleNotFoundError("Could not import module 'LlamaConfig'")

    for func in (rewrapped, plain):
        parser = argparse.ArgumentParser()
        parser.set_defaults(func=func)
        monkeypatch.setattr(cli, "build_parser", lambda parser=parser: parser)
        if func is plain:
            with pytest.raises(ModuleNotFoundError):
                cli.main([])
        else:
            assert cli.main([]) == 130
            assert capsys.readouterr().err.strip().endswith("mm-serve: interrupted")
