"""The HTTP layer's own limits, over raw sockets to a real server: head size (431), head time (closed),
connection cap (429), the API key before any body byte (401), malformed HTTP (400), all in OpenAI's
error JSON; its keys as tenants (``api.cache_salt_by_api_key``: no cache shared across keys); and its bound
on a grammar's compile time."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.server_process import (
    ServerProcess,
    configured_server,
    data_uri,
    requests_counted,
    scrape_metrics,
)
from tests.factories import gradient_image

HEADER_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 12
KEY = "sekret"
OTHER_KEY = "tenant-b-key"
GRAMMAR_COMPILE_S = 0.01


@pytest.fixture(scope="module")
def guarded(tiny_llava: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = {"model": str(tiny_llava), "api": {"api_key": [KEY, OTHER_KEY], "cache_salt_by_api_key": True,
                                                 "max_grammar_compile_s": GRAMMAR_COMPILE_S,
                                                 "header_timeout_s": HEADER_TIMEOUT_S,
                                                 "max_connections": MAX_CONNECTIONS}}
    with configured_server(tiny_llava, config, tmp_path_factory.mktemp("guarded")) as proc:
        yield proc


def _connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.settimeout(10)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def _answer(raw: bytes) -> tuple[int, dict[str, str], dict]:
    """Status, headers (lower-case) and JSON body of one HTTP/1.1 response with a Content-Length."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body[: int(headers["content-length"])])


def test_a_head_over_the_limit_gets_431_whole_or_in_pieces(guarded: ServerProcess) -> None:
    """A 64 KiB header (the default limit is 32 KiB) is refused with 431 ``header_too_large`` and the
    connection closed, whether it arrives with its blank line or never ends; a head just under the
    limit is served."""
    big = b"x-filler: " + b"a" * (64 << 10) + b"\r\n"
    for ending in (b"\r\n", b""):  # complete, then one that never ends
        with _connect(guarded) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n" + big + ending)
            status, headers, body = _answer(_read_all(sock))
        assert status == 431 and headers["connection"] == "close", body
        assert body["error"]["code"] == "header_too_large" and "api.max_header_bytes" in body["error"]["message"]
    fits = httpx.get(f"{guarded.url}/health", headers={"x-filler": "a" * (30 << 10)}, timeout=10)
    assert fits.status_code == 200


def test_a_head_trickled_past_the_header_timeout_is_closed(guarded: ServerProcess) -> None:
    """A byte of head every 0.2 s (slowloris) is closed about ``api.header_timeout_s`` after it began,
    though bytes keep coming; a connection that sends nothing at all likewise."""
    with _connect(guarded) as sock:
        start = time.monotonic()
        closed_at = None
        for byte in b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: " + b"z" * 100:
            try:
                sock.sendall(bytes([byte]))
            except OSError:  # reset: the server closed it
                closed_at = time.monotonic() - start
                break
            sock.settimeout(0.2)
            try:
                if sock.recv(1024) == b"":
                    closed_at = time.monotonic() - start
                    break
            except TimeoutError:
                pass
        assert closed_at is not None and HEADER_TIMEOUT_S * 0.9 <= closed_at <= HEADER_TIMEOUT_S + 1.5, closed_at
    with _connect(guarded) as sock:
        start = time.monotonic()
        assert _read_all(sock) == b""
        assert time.monotonic() - start <= HEADER_TIMEOUT_S + 1.5


def test_an_unauthenticated_upload_gets_401_before_its_body(guarded: ServerProcess) -> None:
    """A 100 MiB file upload without the key gets its 401 after the first 64 KiB of body: the server
    answered on the headers (it never waited for the rest, which is never sent)."""
    boundary = "b0undary"
    with _connect(guarded) as sock:
        sock.sendall(f"POST /v1/files HTTP/1.1\r\nhost: x\r\ncontent-type: multipart/form-data; boundary={boundary}"
                     f"\r\ncontent-length: {100 << 20}\r\n\r\n".encode() + b"x" * (64 << 10))
        start = time.monotonic()
        status, headers, body = _answer(_read_all(sock))
    assert time.monotonic() - start < 5
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    b"GET /health HTTP/1.1\r\nbad header line\r\n\r\n",
])
def test_malformed_http_gets_a_json_400(guarded: ServerProcess, request_bytes: bytes) -> None:
    """What h11 cannot frame gets 400 ``malformed_request`` in OpenAI's error format, not plain text."""
    with _connect(guarded) as sock:
        sock.sendall(request_bytes.replace(b"host: x", f"host: x\r\nauthorization: Bearer {KEY}".encode()))
        status, headers, body = _answer(_read_all(sock))
    assert status == 400 and headers["content-type"] == "application/json"
    assert body["error"]["code"] == "malformed_request" and body["error"]["message"].startswith("malformed HTTP")


def test_connections_past_the_cap_get_429_and_the_server_serves_on(guarded: ServerProcess) -> None:
    """With ``api.max_connections`` connections open (idle), a request on one more gets 429
    ``too_many_connections`` with Retry-After; once they close (the header timeout), requests are served."""
    idle = [_connect(guarded) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        with _connect(guarded) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            status, headers, body = _answer(_read_all(sock))
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert body["error"]["code"] == "too_many_connections" and "api.max_connections" in body["error"]["message"]
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.3)
    assert httpx.get(f"{guarded.url}/health", timeout=10).status_code == 200


def test_a_head_padded_with_whitespace_counts_as_sent(guarded: ServerProcess) -> None:
    """The head's size is what arrived, not what h11 kept: 40 KB of spaces inside one header value gets 431."""
    with _connect(guarded) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: " + b" " * 40_000 + b"b\r\n\r\n")
        status, _, body = _answer(_read_all(sock))
    assert status == 431 and body["error"]["code"] == "header_too_large"


def test_an_unread_body_still_arriving_is_dropped_then_its_connection_closed(guarded: ServerProcess) -> None:
    """A request answered without its body being read (GET /health announcing 60 MB), whose body then trickles
    in a byte a second, is answered and its connection closed about 2 s later (a lingering close), not kept
    open for as long as the bytes come (which let a client hold a connection slot for ever)."""
    with _connect(guarded) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\ncontent-length: 60000000\r\n\r\n")
        assert sock.recv(12) == b"HTTP/1.1 200"
        start = time.monotonic()
        closed = None
        for _ in range(10):
            time.sleep(0.5)
            try:
                sock.sendall(b"x")
                sock.settimeout(0.05)
                while sock.recv(65536):  # the rest of the answer, then the end
                    pass
                closed = time.monotonic() - start
                break
            except TimeoutError:
                continue
            except OSError:
                closed = time.monotonic() - start
                break
    assert closed is not None and closed < 4.0, closed


def test_a_refused_body_the_client_is_still_sending_gets_its_answer_not_a_reset(guarded: ServerProcess) -> None:
    """A 20 MB chat body without the key is refused on its headers; the client, still sending, reads the 401
    (the server drops the rest before closing instead of resetting the connection)."""
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"a" * (20 << 20) + b'"}]}'
    for _ in range(3):
        r = httpx.post(f"{guarded.url}/v1/chat/completions", content=body, timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(("content", "headers", "status", "fragment"), [
    (b'{"model":"tiny","prompt":"hi\xff","max_tokens":2}', {}, 400, "not valid JSON"),
    (b'{"model":"tiny",', {}, 400, "not valid JSON: Expecting property name enclosed in double quotes at character 16"),
    (b'{"model":"tiny","prompt":"hi","zz":' + b"9" * 5000 + b"}", {}, 400, "not valid JSON: an integer of over 4300 digits"),
    (b'{"model":"tiny","prompt":"hi","max_tokens":2}', {"content-encoding": "gzip"}, 415, "Content-Encoding"),
    (json.dumps({"model": "tiny", "prompt": "hi", "stop_token_ids": [1] * 1025}).encode(), {}, 400,
     "api.max_stop_token_ids"),
    (json.dumps({"model": "tiny", "prompt": "hi", "stop_token_ids": [1] * 3_000_000}).encode(), {}, 400,
     "api.max_stop_token_ids"),
    (json.dumps({"model": "m" * 5000, "prompt": "hi"}).encode(), {}, 400, "5000 characters"),
])
def test_bodies_that_fail_to_parse_get_4xx_json(guarded: ServerProcess, content: bytes, headers: dict[str, str],
                                                status: int, fragment: str) -> None:
    """Invalid UTF-8, a body cut short (its position named), an integer past Python's 4300 digits, a compressed body, too many stop_token_ids (inline
    and in the parse process) and an overlong model name: each a 4xx naming why, never a 500."""
    r = httpx.post(f"{guarded.url}/v1/completions", content=content, timeout=60,
                   headers={"content-type": "application/json", "authorization": f"Bearer {KEY}", **headers})
    assert r.status_code == status and fragment in r.json()["error"]["message"], r.text[:300]


def _cached_call(server: ServerProcess, key: str, salt: str | None = None) -> tuple[str, int]:
    """(answer, cached_tokens) of a greedy image question sent with ``key`` (and ``cache_salt`` ``salt``)."""
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(gradient_image(56, 48, 777))}},
        {"type": "text", "text": "Describe the picture in a few words, please. " * 6}]}]}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _encoder_misses(server: ServerProcess) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("mm_serve_encoder_cache_misses_total"))


def _settled_misses(server: ServerProcess, least: float) -> float:
    """The encoder-cache misses once at least ``least`` (the workers' counters reach /metrics with their
    next stats, every 0.5 s), and 0.6 s more to catch any later one."""
    deadline = time.monotonic() + 5
    while _encoder_misses(server) < least and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.6)
    return _encoder_misses(server)


def test_each_api_key_is_a_tenant_whose_caches_no_other_key_reads(guarded: ServerProcess) -> None:
    """Either key is accepted. Tenant A's second call is served from its pages; tenant B's identical
    call reports no cached token and encodes the image again (an encoder-cache miss), yet answers the
    same; then B hits its own. The same ``cache_salt`` under two keys shares nothing either."""
    text, cached = _cached_call(guarded, KEY)
    assert cached == 0
    again, cached_a = _cached_call(guarded, KEY)
    assert again == text and cached_a > 0
    misses = _settled_misses(guarded, 1)  # A's image, encoded once
    other, cached_b = _cached_call(guarded, OTHER_KEY)
    assert other == text and cached_b == 0
    assert _settled_misses(guarded, misses + 1) == misses + 1  # B's image was not read from A's entry
    assert _cached_call(guarded, OTHER_KEY) == (text, cached_a)
    assert _cached_call(guarded, KEY, salt="shared")[1] == 0
    assert _cached_call(guarded, OTHER_KEY, salt="shared")[1] == 0
    assert _cached_call(guarded, OTHER_KEY, salt="shared")[1] == cached_a


def test_a_grammar_slower_to_compile_than_the_limit_is_a_400_and_refused_at_once_again(guarded: ServerProcess) -> None:
    """Four objects of 250 optional properties (within the per-object and total bounds) take longer than
    ``api.max_grammar_compile_s`` (10 ms here): 400 ``grammar_too_complex`` naming the key, and the same
    grammar sent again is refused without compiling; a small grammar is served."""
    slow = {"type": "object", "properties": {f"o{k}": {"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(250)}} for k in range(4)}, "required": [f"o{k}" for k in range(4)]}
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "guided_json": slow}
    for _ in range(2):
        start = time.monotonic()
        r = httpx.post(f"{guarded.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_too_complex", r.text
        assert "api.max_grammar_compile_s" in r.json()["error"]["message"]
    assert time.monotonic() - start < 1.0  # the second: no compile
    body["guided_json"] = None
    body["guided_choice"] = ["yes", "no"]
    r = httpx.post(f"{guarded.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes", "no"), r.text


def test_a_call_past_api_timeout_ms_is_one_503_and_frees_its_pages(tiny_llava: Path, tmp_path: Path) -> None:
    """A call still generating at ``api.timeout_ms``: a 503 naming the key (streamed: that error event, then
    [DONE]); ``mm_serve_requests_total`` counts it once, as the 503 its client saw; its pages go back."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Talk"}], "max_tokens": 3000,
            "ignore_eos": True}
    with configured_server(tiny_llava, {"model": str(tiny_llava), "api": {"timeout_ms": 1000}}, tmp_path) as server:
        before = scrape_metrics(server.url)
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["message"] == "the request did not finish within api.timeout_ms (1000 ms)"
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=60) as streamed:
            lines = [line for line in streamed.iter_lines() if line]
        assert streamed.status_code == 200 and lines[-1] == "data: [DONE]"
        assert "api.timeout_ms (1000 ms)" in json.loads(lines[-2][len("data: "):])["error"]["message"]
        deadline = time.monotonic() + 30
        while True:
            after = scrape_metrics(server.url)
            used = [v for (name, _), v in after.items() if name == "mm_serve_kv_pages_used"]
            if (after[("mm_serve_requests_in_flight", ())] == 0 and not any(used)) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert after[("mm_serve_requests_in_flight", ())] == 0 and used and not any(used)
        assert requests_counted(before, after) == {("error", "503"): 2}
