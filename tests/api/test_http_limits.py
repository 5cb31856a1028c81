"""The HTTP layer's own limits, over raw sockets to a real server: head size (431), head time (closed),
connection cap (429), the API key before any body byte (401), malformed HTTP (400), all in OpenAI's
error JSON."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.server_process import ServerProcess, configured_server

HEADER_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 12
KEY = "sekret"


@pytest.fixture(scope="module")
def guarded(tiny_llava: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = {"model": str(tiny_llava), "api": {"api_key": KEY, "header_timeout_s": HEADER_TIMEOUT_S,
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
