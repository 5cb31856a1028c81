"""Admission on a real server: the predictor's 429, tiers in responses, a burst of large images."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.api.server_process import ServerProcess, configured_server, data_uri
from tests.factories import gradient_image

CONFIG = {
    "slo": {"tiers": {"interactive": {"ttft_ms": 0.01, "tpot_ms": 0.01}}},  # nothing can meet it: always refused
    "admission": {"max_image_bytes_in_flight": 64 << 20, "image_decode_reserve_bytes": 16 << 20, "image_wait_s": 1.0},
    "api": {"body_idle_timeout_s": 2.0},
}


@pytest.fixture(scope="module")
def admission_server(tiny_llava: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with configured_server(tiny_llava, CONFIG, tmp_path_factory.mktemp("admission")) as proc:
        yield proc


def _chat(**overrides: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0, **overrides}


def _wait_idle(url: str, timeout_s: float = 20.0) -> None:
    """Until no request runs or waits on any worker and no image bytes are held (or ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        busy = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith(("mm_serve_requests_running{", "mm_serve_requests_waiting{")))
        held = httpx.get(f"{url}/health", timeout=10).json()["admission"]["image_bytes_in_flight"]
        if busy == 0 and held == 0:
            return
        time.sleep(0.05)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_responses_report_the_tier_served(admission_server: ServerProcess) -> None:
    url = admission_server.url
    r = httpx.post(f"{url}/v1/chat/completions", json=_chat(), timeout=60)
    assert r.status_code == 200 and r.json()["service_tier"] == "default"
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                  "service_tier": "flex"}, timeout=60)
    assert r.status_code == 200 and r.json()["service_tier"] == "flex"


def test_a_predicted_slo_miss_is_a_fast_429_with_retry_after(admission_server: ServerProcess) -> None:
    """Under load (a long request running), a call whose tier's SLO cannot be met is refused at
    once; a request alone on idle workers is never refused (the controller's rule)."""
    url = admission_server.url
    busy = threading.Thread(target=lambda: httpx.post(
        f"{url}/v1/chat/completions", json=_chat(max_tokens=2000, ignore_eos=True), timeout=120))
    busy.start()
    time.sleep(0.3)
    started = time.monotonic()
    r = httpx.post(f"{url}/v1/chat/completions", json=_chat(service_tier="priority"), timeout=60)
    elapsed = time.monotonic() - started
    # refused before its images are decoded: an undecodable one gets the 429, not the 400 it would get after
    broken = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                           {"type": "text", "text": "hi"}]}]
    early = httpx.post(f"{url}/v1/chat/completions", json=_chat(service_tier="priority", messages=broken), timeout=60)
    busy.join()
    assert early.status_code == 429 and early.json()["error"]["code"] == "ttft_slo"
    error = r.json()["error"]
    assert r.status_code == 429 and error["type"] == "rate_limit_error" and error["code"] == "ttft_slo"
    assert int(r.headers["retry-after"]) >= 1
    assert "interactive tier" in error["message"] and "TTFT SLO of 0.000 s" in error["message"]
    assert elapsed < 2.0
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'mm_serve_tier_rejected_total{reason="ttft_slo",tier="interactive"} 2.0' in metrics
    assert 'mm_serve_tier_admitted_total{tier="standard"}' in metrics
    health = httpx.get(f"{url}/health", timeout=10).json()
    assert health["admission"]["predict"] is True and health["admission"]["prefill"]["observations"] >= 1
    assert health["admission"]["prefill"]["age_s"] is not None
    feedback = health["admission"]["attainment_feedback"]  # the busy standard request (and earlier ones) finished
    assert feedback["standard"]["ttft"]["late"] + feedback["standard"]["ttft"]["in_time"] >= 1
    assert feedback["interactive"]["ttft"] == {"factor": 1.0, "late": 0, "in_time": 0}  # none served
    assert 'mm_serve_tier_admission_limit_factor{slo="ttft",tier="interactive"} 1.0' in metrics


def test_a_burst_of_large_images_waits_or_gets_429_and_memory_stays_bounded(admission_server: ServerProcess) -> None:
    """16 calls of 2 images at once: those past the 64 MiB budget wait for room (1 s here), then get 429
    ``image_bytes`` + Retry-After, never a 5xx; the API process grows by less than the budget plus the bodies
    (raw and parsed); a normal request then passes.
    (A call admitted past the budget may still be refused by the prediction, 429 + Retry-After:
    the seconds it spent decoding its images count in its TTFT.)"""
    url = admission_server.url
    big = data_uri(gradient_image(1200, 1200))  # ~4 MB PNG, 4.3 MB decoded
    body = _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": big}}, {"type": "image_url", "image_url": {"url": big}},
        {"type": "text", "text": "what is it?"}]}])
    content = json.dumps(body).encode()  # once: 16 threads encoding 8 MB each would time this process, not the server
    rss_before = _rss_bytes(admission_server.proc.pid)

    def send(_: int) -> tuple[int, float, str | None, float]:
        started = time.monotonic()
        r = httpx.post(f"{url}/v1/chat/completions", content=content, timeout=120,
                       headers={"content-type": "application/json"})
        app = r.headers["server-timing"].split(",")[0]  # "app;dur=MS", then the handler's phases
        server_ms = float(app.partition("app;dur=")[2])  # arrival (body included) to response
        return r.status_code, time.monotonic() - started, r.headers.get("retry-after"), server_ms

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(send, range(16)))
    assert {status for status, *_ in results} <= {200, 429}, results
    assert all(retry is not None and int(retry) >= 1 for status, _, retry, _ in results if status == 429)
    assert any(status == 200 for status, *_ in results)
    growth = _rss_bytes(admission_server.proc.pid) - rss_before
    # the budget, plus every body held twice while its call is handled (the request's raw bytes and the
    # parsed strings): on a loaded machine all 16 arrive and are parsed before the first is answered
    assert growth < (64 << 20) + 16 * 2 * len(content), growth
    r = httpx.post(f"{url}/v1/chat/completions", json=_chat(), timeout=30)
    assert r.status_code == 200


def test_a_call_still_decoding_its_images_at_the_decision_deadline_is_decided_then(admission_server: ServerProcess) -> None:
    """An interactive call of three 4000x4000 images (cheap to send, ~0.2 s each to decode) arrives
    on an idle service, so the early check passes; a long request is sent while its images decode.
    Decided after its images (as before admission.decide_within_ms), the call would be refused
    then, its prediction over the tier's 0.01 ms SLO. Decided at the deadline (15 ms), it is
    either refused then, in well under the time its images take, or committed: answered 200
    although its final prediction misses the SLO."""
    url = admission_server.url
    big = data_uri(Image.new("RGB", (4000, 4000), (120, 30, 200)))  # ~75 kB of PNG, 48 MB decoded
    call = _chat(service_tier="priority", stream=True, messages=[{"role": "user", "content": [
        *[{"type": "image_url", "image_url": {"url": big}}] * 3, {"type": "text", "text": "what is it?"}]}])

    def attempt(delay_s: float) -> tuple[httpx.Response, str, dict[str, str]]:
        _wait_idle(url)  # "an idle service": nothing of an earlier test (or attempt) still running or held
        busy = threading.Thread(target=lambda: httpx.post(
            f"{url}/v1/chat/completions", json=_chat(max_tokens=500, ignore_eos=True), timeout=120))
        starter = threading.Thread(target=lambda: (time.sleep(delay_s), busy.start()))
        starter.start()
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=call, timeout=60) as r:
            body = r.read().decode()
        starter.join()
        busy.join()
        return r, body, dict(e.strip().partition(";dur=")[::2] for e in r.headers["server-timing"].split(","))

    for k in range(4):  # refused at the early check (the long request got in first on a slow machine): later
        r, body, timing = attempt(0.15 * 2**k)
        if "precheck" in timing:
            break
    assert "precheck" in timing, timing
    if r.status_code == 429:
        assert "media" not in timing and float(timing["app"]) < 150.0, timing
        assert json.loads(body)["error"]["code"] == "ttft_slo"
    else:
        assert r.status_code == 200 and "data: [DONE]" in body
        assert float(timing["media"]) > 15.0, timing  # its images took longer than the deadline
        assert float(r.headers["x-mm-serve-predicted-ttft-ms"]) > 0.01  # over the SLO: committed, not refused
    outcome = "refused" if r.status_code == 429 else "committed"
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert f'mm_serve_tier_decided_at_deadline_total{{outcome="{outcome}",tier="interactive"}} 1.0' in metrics


def _raw_post_headers(url: str, path: str, length: int, source: str | None = None) -> socket.socket:
    """A connection (from loopback address ``source``, when given) that has sent a POST's headers
    announcing ``length`` bytes of body, and no body."""
    host, port = url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)), timeout=10, source_address=(source, 0) if source else None)
    conn.sendall(f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                 f"content-length: {length}\r\n\r\n".encode())
    return conn


def _read_response(conn: socket.socket) -> tuple[int, dict[str, str], dict[str, Any]]:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    headers = {k.lower(): v for k, v in headers.items()}
    while len(rest) < int(headers["content-length"]):
        rest += conn.recv(65536)
    return int(lines[0].split()[1]), headers, json.loads(rest)


def test_bodies_being_read_count_against_the_image_budget(admission_server: ServerProcess) -> None:
    """Four 15 MiB uploads still arriving, from four client addresses, hold 60 of the 64 MiB
    budget: a call announcing an 8 MiB body waits ``admission.image_wait_s`` (1 s here) for room, then is
    refused with 429 ``image_bytes`` before it sends a byte of it (the budget is checked on its
    Content-Length, not after reading and parsing it);
    once they are gone, a call with an image is answered. One address holds at most a quarter
    of the budget ahead of its bytes: a fifth announced body from the first address holds only
    what it sent."""
    url = admission_server.url
    slow = [_raw_post_headers(url, "/v1/chat/completions", 15 << 20, f"127.0.0.{i}") for i in range(2, 6)]
    try:
        for conn in slow:
            conn.sendall(b'{"model": "tiny", "messages": [')  # the rest never comes while the others are made
        time.sleep(0.3)
        health = httpx.get(f"{url}/health", timeout=10).json()
        started = time.monotonic()
        second = _raw_post_headers(url, "/v1/chat/completions", 8 << 20)
        with second:
            status, headers, body = _read_response(second)
        elapsed = time.monotonic() - started
        with _raw_post_headers(url, "/v1/chat/completions", 4 << 20, "127.0.0.2") as over_share:
            over_share.sendall(b"{")
            time.sleep(0.3)
            held_after_fifth = httpx.get(f"{url}/health", timeout=10).json()["admission"]["image_bytes_in_flight"]
    finally:
        for conn in slow:
            conn.close()
    assert held_after_fifth == (60 << 20) + 1  # 15 MiB ahead was 127.0.0.2's share; its fifth holds its 1 byte
    assert health["admission"]["image_bytes_in_flight"] == 60 << 20
    assert health["admission"]["max_image_bytes_in_flight"] == 64 << 20
    assert status == 429 and body["error"]["code"] == "image_bytes", (status, body)
    assert headers["retry-after"] == "1" and body["error"]["type"] == "rate_limit_error"
    assert "max_image_bytes_in_flight" in body["error"]["message"] and "admission.image_wait_s" in body["error"]["message"]
    assert 1.0 <= elapsed < 3.0
    call = _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(gradient_image(64, 64))}}, {"type": "text", "text": "what?"}]}])
    for _ in range(50):  # the first connection's close reaches the server
        r = httpx.post(f"{url}/v1/chat/completions", json=call, timeout=60)
        if r.status_code != 429:
            break
        time.sleep(0.1)
    assert r.status_code == 200, r.text
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'status_code="429"' in metrics and "mm_serve_image_bytes_in_flight 0.0" in metrics


def test_a_stalled_upload_gets_408_and_its_connection_is_closed(admission_server: ServerProcess) -> None:
    """A body that stops (api.body_idle_timeout_s, 2 s here) is answered 408 ``body_timeout`` and the
    server closes the connection; the bytes it declared are free again."""
    url = admission_server.url
    stalled = _raw_post_headers(url, "/v1/chat/completions", 60 << 20)
    with stalled:
        stalled.sendall(b'{"model": "tiny", ')
        started = time.monotonic()
        status, headers, body = _read_response(stalled)
        elapsed = time.monotonic() - started
        stalled.settimeout(5)
        assert stalled.recv(1) == b""  # closed by the server
    assert status == 408 and body["error"]["code"] == "body_timeout" and "18 bytes arrived" in body["error"]["message"]
    assert 1.9 <= elapsed < 5.0
    assert httpx.get(f"{url}/health", timeout=10).json()["admission"]["image_bytes_in_flight"] == 0


def test_a_colocated_server_learns_its_step_times(tiny_llava: Path, tmp_path: Path) -> None:
    """The colocated worker reports its steps (its prefill steps with the decode batch beside them, and
    its decode steps): the fits learn them, so the corrections, learned against the fits as they
    price a request when it finishes, stay near 1 on an unloaded server. (With no steps reported the
    fits keep their starting coefficients and the corrections rise to their bound of 10.)"""
    with configured_server(tiny_llava, {"mode": "colocated"}, tmp_path) as proc:
        image = data_uri(gradient_image(300, 200))
        for i in range(8):
            content: Any = "hi there" if i % 2 else [{"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": f"picture {i}"}]
            r = httpx.post(f"{proc.url}/v1/chat/completions", json=_chat(
                messages=[{"role": "user", "content": content}], max_tokens=8, ignore_eos=True), timeout=60)
            assert r.status_code == 200, r.text
        _wait_idle(proc.url)
        health = httpx.get(f"{proc.url}/health", timeout=10).json()
    admission = health["admission"]
    # one worker runs both phases: the placement names the mode, no counts of prefill or decode workers
    assert health["placement"]["mode"] == "colocated" and health["placement"]["source"] == "config"
    assert not {"prefill_workers", "decode_workers"} & health["placement"].keys()
    assert set(health["workers"]) == {"colocated0"}
    assert admission["prefill"]["observations"] >= 8  # a step with prompts in it each
    assert admission["decode"]["observations"] >= 8 * 6  # the 7 steps after each first token, less mixed ones
    assert admission["prefill"]["worker_speed"].keys() == admission["decode"]["worker_speed"].keys() == {"0"}
    assert 0.25 < admission["ttft_correction"]["standard"] < 2.0
    assert 0.25 < admission["tpot_correction"] < 2.0
    assert admission["media"]["observations"] >= 8 and admission["media"]["in_flight"] == 0  # data: URIs and text
