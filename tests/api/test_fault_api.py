"""Faults seen through the HTTP API: a killed worker mid-stream, /health and /metrics while it
restarts, and the error event + [DONE] past ``fault.max_migrations``."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mm_serve.cluster.stale_instances import SHM_DIR, process_start_time
from tests.api.server_process import ServerProcess, data_uri, worker_children
from tests.factories import gradient_image


def start(model: Path, tmp_path: Path, max_migrations: int) -> ServerProcess:
    config = tmp_path / "fault.yaml"
    config.write_text(f"fault:\n  heartbeat_timeout_s: 2.0\n  restart_backoff_s: 0.1\n  max_migrations: {max_migrations}\n")
    proc = ServerProcess(model, "--config", str(config), log_dir=tmp_path)
    proc.wait_ready()
    return proc


@pytest.fixture
def server(tiny_llava: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    proc = start(tiny_llava, tmp_path, getattr(request, "param", 3))
    try:
        yield proc
    finally:
        assert proc.stop() == 0


def chat_body(stream: bool) -> dict:
    content = [{"type": "image_url", "image_url": {"url": data_uri(gradient_image(44, 40, 7))}},
               {"type": "text", "text": "Describe the picture at length"}]
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 200,
            "temperature": 0, "ignore_eos": True, "stream": stream}


def decode_pid(server: ServerProcess) -> int:
    stats = httpx.get(f"{server.url}/internal/stats", timeout=10).json()
    return int(stats["decode0"]["pid"])


def stream_killing_decode(server: ServerProcess, after_chunks: int) -> tuple[list[str], list[dict]]:
    """Stream a chat completion, SIGKILL the decode worker after ``after_chunks`` content chunks;
    returns the stream's lines and the /health bodies polled right after the kill."""
    pid = decode_pid(server)
    lines: list[str] = []
    health: list[dict] = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=chat_body(True), timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line:
                continue
            lines.append(line)
            if len(lines) == after_chunks + 1:
                os.kill(pid, signal.SIGKILL)
                time.sleep(0.3)  # the supervisor checks every 0.1 s
                got = httpx.get(f"{server.url}/health", timeout=10)
                health.append({"code": got.status_code, **got.json()})
    return lines, health


def test_decode_killed_mid_stream_the_client_sees_one_full_stream(server: ServerProcess) -> None:
    reference = httpx.post(f"{server.url}/v1/chat/completions", json=chat_body(False), timeout=120).json()
    expected = reference["choices"][0]["message"]["content"]
    lines, health = stream_killing_decode(server, after_chunks=10)
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert not [c for c in chunks if "error" in c]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == expected and len(text) > 0
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    # right after the kill: no decode path, 503 "down", the worker restarting
    assert health[0]["code"] == 503 and health[0]["status"] == "down"
    assert health[0]["workers"]["decode0"] == "restarting" and "code -9" in health[0]["faults"]["decode0"]
    after = httpx.get(f"{server.url}/health", timeout=10)
    assert after.status_code == 200 and after.json()["status"] == "ok"
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'mm_serve_worker_restarts_total{role="decode"} 1.0' in metrics
    assert 'mm_serve_request_migrations_total{role="decode"} 1.0' in metrics
    assert 'mm_serve_requests_failed_by_fault_total{role="decode"} 0.0' in metrics
    assert 'mm_serve_worker_ready{worker="decode0"} 1.0' in metrics


@pytest.mark.parametrize("server", [0], indirect=True)
def test_past_max_migrations_the_stream_ends_with_an_error_event_and_done(server: ServerProcess) -> None:
    lines, _ = stream_killing_decode(server, after_chunks=5)
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    error = json.loads(lines[-2][6:])["error"]
    assert error["type"] == "service_unavailable" and "fault.max_migrations = 0" in error["message"]
    # not streamed: 503 in OpenAI's error JSON (decode held stopped so the request is surely on it)
    deadline = time.monotonic() + 60
    while httpx.get(f"{server.url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    pid = decode_pid(server)
    os.kill(pid, signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, f"{server.url}/v1/chat/completions", json=chat_body(False), timeout=120)
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        r = answer.result()
    assert r.status_code == 503 and "fault.max_migrations = 0" in r.json()["error"]["message"]


def test_sigterm_while_the_only_decode_restarts_still_drains(tiny_llava: Path, tmp_path: Path) -> None:
    """No path serves at the signal (decode restarting): the drain still lets the parked stream finish."""
    config = tmp_path / "fault.yaml"
    config.write_text("fault:\n  restart_backoff_s: 3.0\n")
    server = ServerProcess(tiny_llava, "--config", str(config), log_dir=tmp_path)
    try:
        server.wait_ready()
        os.kill(decode_pid(server), signal.SIGKILL)
        time.sleep(0.5)
        assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "down"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            def streamed() -> list[str]:
                with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=chat_body(True),
                                  timeout=120) as r:
                    return [ln for ln in r.iter_lines() if ln]

            lines = pool.submit(streamed)
            deadline = time.monotonic() + 30
            while "mm_serve_requests_in_flight 1.0" not in httpx.get(f"{server.url}/metrics", timeout=10).text:
                assert time.monotonic() < deadline, "the stream was never parked"  # submitted, waiting for a decode
                time.sleep(0.05)
            server.proc.send_signal(signal.SIGTERM)
            got = lines.result()
        assert got[-1] == "data: [DONE]" and not [ln for ln in got if '"error"' in ln]
        assert server.proc.wait(60) in (0, -signal.SIGTERM)  # stopped by its own drain
        assert "stopping: new requests get 503" in server.output()
    finally:
        server.stop()


def test_a_stop_while_a_worker_restarts_does_not_wait_for_it(tiny_llava: Path, tmp_path: Path) -> None:
    """SIGINT while the decode worker is being restarted (killed, its successor still loading): the server
    exits 0 within 5 s and the successor is gone. It was waited for 10 s: the Shutdown message never
    reached a worker that had not connected yet."""
    server = start(tiny_llava, tmp_path, 3)
    try:
        old = decode_pid(server)
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while [old] == (decode := worker_children(server.proc.pid, "decode")) or not decode:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        (new,) = decode
        assert httpx.get(f"{server.url}/health", timeout=10).json()["workers"]["decode0"] != "ready"
        stopped = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(60) == 0
        assert time.monotonic() - stopped < 5.0, server.output()[-2000:]
    finally:
        server.stop()
    assert process_start_time(new) is None


@pytest.mark.parametrize("exits", [True, False])
def test_a_role_down_for_good_exits_the_service_for_its_supervisor_unless_asked_to_stay(
        tiny_llava: Path, tmp_path: Path, exits: bool) -> None:
    """The only decode worker killed with no restart allowed: the stream in flight ends with an error event
    and [DONE]; with ``fault.exit_when_unavailable`` (the default) the server then exits 1, its workers and
    shared memory gone (a supervisor starts a fresh one), else it stays up answering 503."""
    config = tmp_path / "fault.yaml"
    config.write_text(f"fault:\n  max_restarts: 0\n  exit_when_unavailable: {str(exits).lower()}\n")
    before = {p.name for p in SHM_DIR.glob("mmsrv-*")}
    server = ServerProcess(tiny_llava, "--config", str(config), log_dir=tmp_path)
    try:
        server.wait_ready()
        workers = worker_children(server.proc.pid)
        mine = {p.name for p in SHM_DIR.glob("mmsrv-*")} - before
        assert len(workers) == 2 and mine
        pid, lines = decode_pid(server), []
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=chat_body(True), timeout=120) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 4:
                    os.kill(pid, signal.SIGKILL)
        lines = [line for line in lines if line]
        assert '"error"' in lines[-2] and "every decode worker is down" in lines[-2] and lines[-1] == "data: [DONE]"
        if exits:
            assert server.proc.wait(60) == 1
            assert "exiting so that a supervisor can start the service again" in server.output()
            assert all(process_start_time(pid) is None for pid in workers)
            assert not mine & {p.name for p in SHM_DIR.glob("mmsrv-*")}
        else:
            time.sleep(1.0)
            assert server.proc.poll() is None
            health = httpx.get(f"{server.url}/health", timeout=10)
            assert health.status_code == 503 and health.json()["status"] == "down"
            refused = httpx.post(f"{server.url}/v1/chat/completions", json=chat_body(False), timeout=30)
            assert refused.status_code == 503 and "every decode worker is down" in refused.json()["error"]["message"]
    finally:
        server.stop()
