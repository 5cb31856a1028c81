"""The batch tier on a real server: held while it would slow a tighter tier, then answered."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mm_serve.protocol.errors import STOPPED_MESSAGE
from tests.api.server_process import ServerProcess, configured_server

# a standard TPOT SLO no decode step meets: a batch request joining a running standard one is held
CONFIG = {"slo": {"tiers": {"interactive": {"ttft_ms": 1000, "tpot_ms": 0.001},
                            "standard": {"ttft_ms": 4000, "tpot_ms": 0.001}}}}


@pytest.fixture(scope="module")
def hold_server(tiny_llava: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with configured_server(tiny_llava, CONFIG, tmp_path_factory.mktemp("hold")) as proc:
        yield proc


def _body(tier: str, max_tokens: int) -> dict[str, object]:
    return {"model": "tiny", "prompt": "hi", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "service_tier": tier}


def _decoding_standard(url: str, max_tokens: int, finished: dict[str, float]) -> threading.Thread:
    """Start a standard-tier stream of ``max_tokens`` tokens and return its thread once it decodes; the time
    it ended goes to ``finished["standard"]``. Its TPOT SLO no step meets, so it is admitted only on an
    idle service: refused (429) while the requests of the test before are still leaving, it is sent again."""
    decoding = threading.Event()

    def standard() -> None:
        body = {**_body("default", max_tokens), "stream": True}
        for _ in range(50):
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                if r.status_code == 429:
                    r.read()
                    time.sleep(0.1)
                    continue
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        decoding.set()
            finished["standard"] = time.monotonic()
            return

    runner = threading.Thread(target=standard)
    runner.start()
    assert decoding.wait(60)  # its tokens are streaming: it is decoding now
    return runner


def _wait_until_held(url: str, key: str = "requests_waiting", above: int = 0) -> None:
    """Return once ``/health``'s ``admission.held[key]`` is above ``above`` (a batch call is held)."""
    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/health", timeout=10).json()["admission"]["held"][key] <= above:
        assert time.monotonic() < deadline, f"no batch call was held ({key} stayed at {above})"
        time.sleep(0.05)


def _flex_image_body() -> dict[str, object]:
    return {"model": "tiny", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "service_tier": "flex",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_data_uri()}},
                                                      {"type": "text", "text": "what is this?"}]}]}


def test_a_batch_call_waits_for_a_running_standard_request_then_is_answered(hold_server: ServerProcess) -> None:
    url = hold_server.url
    finished: dict[str, float] = {}
    runner = _decoding_standard(url, 2000, finished)
    r = httpx.post(f"{url}/v1/completions", json=_body("flex", 4), timeout=120)
    answered = time.monotonic()
    runner.join()
    assert r.status_code == 200 and r.json()["service_tier"] == "flex"
    assert r.json()["usage"]["completion_tokens"] == 4
    # it was let go when the standard request finished, not before (its longest hold is 30 s)
    assert answered >= finished["standard"] - 0.05
    held = httpx.get(f"{url}/health", timeout=10).json()["admission"]["held"]
    assert held["calls_held"] >= 1 and held["released_by_time"] == 0 and held["requests_waiting"] == 0


def test_a_batch_call_with_an_image_waits_before_its_image_is_decoded(hold_server: ServerProcess) -> None:
    """A batch-tier chat call with an image, sent while a standard request decodes, waits before its media
    work (its image is decoded only once it may go: decoding takes a core from the workers), then is
    answered; /health counts it held before its media work and shows the media threads."""
    url = hold_server.url
    before = httpx.get(f"{url}/health", timeout=10).json()["admission"]
    results: dict[str, Any] = {}

    def flex() -> None:
        results["flex"] = httpx.post(f"{url}/v1/chat/completions", json=_flex_image_body(), timeout=180)
        results["answered"] = time.monotonic()

    finished: dict[str, float] = {}
    runner = _decoding_standard(url, 1500, finished)
    waiter = threading.Thread(target=flex)
    waiter.start()
    _wait_until_held(url, "calls_held_before_media", before["held"]["calls_held_before_media"])
    assert results.get("flex") is None  # still waiting
    runner.join(120)
    waiter.join(120)
    reply = results["flex"]
    assert reply.status_code == 200, reply.text
    assert reply.json()["service_tier"] == "flex" and reply.json()["usage"]["completion_tokens"] == 3
    assert results["answered"] >= finished["standard"] - 0.05
    after = httpx.get(f"{url}/health", timeout=10).json()["admission"]
    assert after["held"]["requests_waiting"] == 0 and after["held"]["released_by_time_before_media"] == 0
    assert after["media"]["threads"] >= 1 and after["media"]["threads_busy"] == 0
    assert after["media"]["steps_waiting"] == 0


def test_the_queue_caps_count_calls_held_before_their_media_work(tiny_llava: Path, tmp_path: Path) -> None:
    """With a cap of one queued request, a batch call with an image held before its media work fills it:
    a second one is refused (429 queued_requests) before it waits, and the first is answered."""
    config = {**CONFIG, "admission": {"max_queued_requests": 1}}
    with configured_server(tiny_llava, config, tmp_path) as server:
        url = server.url
        results: dict[str, Any] = {}
        finished: dict[str, float] = {}

        def flex(key: str) -> None:
            results[key] = httpx.post(f"{url}/v1/chat/completions", json=_flex_image_body(), timeout=180)

        runner = _decoding_standard(url, 1200, finished)
        first = threading.Thread(target=flex, args=("first",))
        first.start()
        _wait_until_held(url)
        flex("second")
        assert runner.is_alive()  # refused at once, not after waiting for the standard request to end
        refused = results["second"]
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queued_requests", refused.text
        assert refused.headers.get("retry-after")
        runner.join(120)
        first.join(120)
        assert results["first"].status_code == 200, results["first"].text


def _png_data_uri() -> str:
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 90)).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture()
def fresh_hold_server(tiny_llava: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    """A server of its own: its predictor has not yet measured a decode step, so the standard
    request (whose TPOT SLO no step meets) is admitted rather than refused."""
    with configured_server(tiny_llava, CONFIG, tmp_path) as proc:
        yield proc


def _hold_behind_a_standard_stream(url: str, standard_tokens: int, flex_tokens: int,
                                   results: dict[str, Any]) -> tuple[threading.Thread, threading.Thread]:
    """Start a standard-tier stream of ``standard_tokens`` (its text and usage go to
    ``results["standard"]``, the code of an error event to ``results["standard_error"]``), then, once it
    decodes, a batch-tier call of ``flex_tokens`` (its response goes to ``results["flex"]``); returns their
    threads once the batch call is held."""
    decoding = threading.Event()

    def standard() -> None:
        text, usage = [], {}
        body = {**_body("default", standard_tokens), "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as r:
            if r.status_code != 200:
                open("/tmp/w/dbg.txt", "w").write(r.read().decode() + "\n" + httpx.get(f"{url}/internal/stats", timeout=10).text + "\n" + httpx.get(f"{url}/health", timeout=10).text)
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:  # the stream was cut: its last event
                        results["standard_error"] = chunk["error"]["code"]
                        continue
                    text += [c["text"] for c in chunk["choices"]]
                    usage = chunk.get("usage") or usage
                    decoding.set()
        results["standard"] = ("".join(text), usage)

    def flex() -> None:
        results["flex"] = httpx.post(f"{url}/v1/completions", json=_body("flex", flex_tokens), timeout=180)

    runner = threading.Thread(target=standard)
    runner.start()
    assert decoding.wait(60)
    waiter = threading.Thread(target=flex)
    waiter.start()
    _wait_until_held(url)
    return runner, waiter


def test_a_held_call_survives_a_killed_decode_worker(fresh_hold_server: ServerProcess) -> None:
    """SIGKILL of the decode worker while a batch call is held behind a decoding standard request:
    the standard request is migrated and finishes whole, the held call is then answered, and the
    worker comes back."""
    url = fresh_hold_server.url
    results: dict[str, Any] = {}
    runner, waiter = _hold_behind_a_standard_stream(url, 600, 4, results)
    decode_pid = int(httpx.get(f"{url}/internal/stats", timeout=30).json()["decode0"]["pid"])
    os.kill(decode_pid, signal.SIGKILL)
    runner.join(180)
    waiter.join(180)
    assert not runner.is_alive() and not waiter.is_alive()
    streamed, usage = results["standard"]
    assert usage["completion_tokens"] == 600
    flex_reply = results["flex"]
    assert flex_reply.status_code == 200, flex_reply.text
    assert flex_reply.json()["usage"]["completion_tokens"] == 4
    deadline = time.monotonic() + 60
    while (health := httpx.get(f"{url}/health", timeout=10).json())["status"] != "ok":
        assert time.monotonic() < deadline, health
        time.sleep(0.2)
    assert health["workers"]["decode0"] == "ready" and health["admission"]["held"]["requests_waiting"] == 0
    again = httpx.post(f"{url}/v1/completions", json=_body("flex", 600), timeout=180).json()
    assert again["choices"][0]["text"] == streamed  # greedy: the migrated stream lost and repeated nothing


def test_a_call_held_when_a_drain_begins_is_answered_before_the_exit(fresh_hold_server: ServerProcess) -> None:
    """SIGTERM while a batch call is held behind a decoding standard request: the drain waits for the
    held call too (it is being admitted, not yet submitted), so once the standard request ends it is
    let go, decoded and answered 200 before the server exits 0. (The drain counted submitted requests
    only: ending when the standard one did, it could miss the call let go then, and the exit cut it.)"""
    results: dict[str, Any] = {}
    runner, waiter = _hold_behind_a_standard_stream(fresh_hold_server.url, 2000, 200, results)
    fresh_hold_server.proc.send_signal(signal.SIGTERM)
    runner.join(120)
    waiter.join(120)
    assert fresh_hold_server.proc.wait(60) == 0, fresh_hold_server.output()[-2000:]
    reply = results["flex"]
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 200
    assert "still in flight" not in fresh_hold_server.output()


def test_a_call_held_before_its_media_work_gets_the_stopping_503_when_the_drain_begins(
        fresh_hold_server: ServerProcess) -> None:
    """SIGTERM while a batch call with an image is held before its media work: nothing has been done for it,
    so it is answered 503 (as a call arriving during the drain) at once, not held through the drain and
    its image decoded for nothing; the standard request streams to its end and the server exits 0."""
    url = fresh_hold_server.url
    finished: dict[str, float] = {}
    results: dict[str, Any] = {}
    runner = _decoding_standard(url, 1500, finished)

    def flex() -> None:
        results["flex"] = httpx.post(f"{url}/v1/chat/completions", json=_flex_image_body(), timeout=180)
        results["answered"] = time.monotonic()

    waiter = threading.Thread(target=flex)
    waiter.start()
    _wait_until_held(url)
    signalled = time.monotonic()
    fresh_hold_server.proc.send_signal(signal.SIGTERM)
    waiter.join(60)
    reply = results["flex"]
    assert reply.status_code == 503 and "shutting down" in reply.json()["error"]["message"], reply.text
    assert results["answered"] - signalled < 2.0 and runner.is_alive()
    runner.join(120)
    assert "standard" in finished
    assert fresh_hold_server.proc.wait(60) == 0, fresh_hold_server.output()[-2000:]


def test_a_call_still_held_when_the_drain_is_cut_gets_503_at_once(fresh_hold_server: ServerProcess) -> None:
    """A second SIGTERM ends the drain while a batch call is still held: the call is answered 503 (OpenAI's
    error JSON, Retry-After) within a fraction of a second, not after uvicorn's 5 s wait for open
    connections, whose cancelling of the held call's task logged an ERROR."""
    results: dict[str, Any] = {}
    # 3000 tokens: ~2 s of decode on a fast CPU, still running at the second signal (once it ends, the drain
    # lets the held call go and serves it)
    runner, waiter = _hold_behind_a_standard_stream(fresh_hold_server.url, 3000, 4, results)
    fresh_hold_server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    cut = time.monotonic()
    fresh_hold_server.proc.send_signal(signal.SIGTERM)
    waiter.join(30)
    answered = time.monotonic() - cut
    runner.join(30)
    assert fresh_hold_server.proc.wait(60) == 0, fresh_hold_server.output()[-2000:]
    reply = results["flex"]
    assert reply.status_code == 503 and int(reply.headers["retry-after"]) >= 1, reply.text
    assert reply.json()["error"]["message"] == STOPPED_MESSAGE
    assert results["standard_error"] == "service_unavailable"  # the stream was cut by the second signal too
    assert answered < 2.0
    assert "ERROR" not in fresh_hold_server.output(), fresh_hold_server.output()[-2000:]
