"""Generation bodies read by the body middleware (docs/admission.md, step 0): a
call without the API key holds nothing of the image budget, and a body that stalls or trickles
gets 408 and gives its hold back. The app is real; its workers are never started, and the ASGI
messages are driven by hand so that a client can stall exactly where a test wants."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from mm_serve.config import load_config
from mm_serve.engine.engine_holder import EngineHolder
from mm_serve.pipeline.context import ServerContext
from mm_serve.server.app import build_app

BUDGET_BYTES = 4 << 20  # admission.max_image_bytes_in_flight: one client may hold 1 MiB of it ahead
BODY_BYTES = 512 << 10  # declared by each call


def _context(tiny_llava: Path) -> ServerContext:
    cfg = load_config(None, {"model": str(tiny_llava), "api.api_key": "sekret",
                             "admission.max_image_bytes_in_flight": BUDGET_BYTES,
                             "api.body_idle_timeout_s": 0.3, "api.body_read_timeout_s": 1.0})
    return ServerContext(holder=EngineHolder(tiny_llava, cfg), config=cfg, served_model_name="tiny")


def _scope(key: str, client: str = "127.0.0.1", length: int = BODY_BYTES) -> dict[str, Any]:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(length).encode()),
               (b"authorization", f"Bearer {key}".encode())]
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
            "root_path": "", "headers": headers, "client": (client, 40000), "server": ("127.0.0.1", 8000)}


async def _call(app: Any, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                timeout_s: float = 10.0) -> tuple[int, dict[str, str], dict[str, Any], float]:
    """(status, headers, JSON body, seconds) of one call to ``app``."""
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    started = time.monotonic()
    await asyncio.wait_for(app(scope, receive, send), timeout_s)
    elapsed = time.monotonic() - started
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], headers, json.loads(body), elapsed


async def _stalled() -> dict[str, Any]:
    await asyncio.sleep(3600)  # a client that never sends its body
    raise AssertionError("unreachable")


def test_a_call_without_the_key_is_refused_before_it_holds_the_budget(tiny_llava: Path) -> None:
    ctx = _context(tiny_llava)
    app = build_app(ctx, start_engine=False)
    status, headers, body, elapsed = asyncio.run(_call(app, _scope("wrong"), _stalled))
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and headers["www-authenticate"] == "Bearer"
    assert elapsed < 1.0 and ctx.image_budget.reserved == 0


def test_a_stalled_body_gets_408_and_gives_its_hold_back(tiny_llava: Path) -> None:
    ctx = _context(tiny_llava)
    app = build_app(ctx, start_engine=False)
    held: list[int] = []

    async def one_chunk_then_silence() -> dict[str, Any]:
        if not held:
            held.append(ctx.image_budget.reserved)
            return {"type": "http.request", "body": b'{"model": "tiny", ', "more_body": True}
        held.append(ctx.image_budget.reserved)
        return await _stalled()

    status, headers, body, elapsed = asyncio.run(_call(app, _scope("sekret"), one_chunk_then_silence))
    assert len(held) >= 2 and set(held) == {BODY_BYTES}  # the declared length, held while the body was awaited
    assert status == 408 and body["error"]["code"] == "body_timeout" and headers["connection"] == "close"
    assert "api.body_read_timeout_s" in body["error"]["message"]
    assert "api.body_idle_timeout_s" in body["error"]["message"] and "18 bytes arrived" in body["error"]["message"]
    assert 0.25 <= elapsed < 1.0
    assert ctx.image_budget.reserved == 0


def test_a_trickling_body_gets_408_at_the_read_timeout(tiny_llava: Path) -> None:
    ctx = _context(tiny_llava)
    app = build_app(ctx, start_engine=False)

    async def a_byte_every_100_ms() -> dict[str, Any]:
        await asyncio.sleep(0.1)
        return {"type": "http.request", "body": b" ", "more_body": True}

    status, _, body, elapsed = asyncio.run(_call(app, _scope("sekret"), a_byte_every_100_ms))
    assert status == 408 and body["error"]["code"] == "body_timeout"
    assert 0.9 <= elapsed < 2.0 and ctx.image_budget.reserved == 0


def test_a_complete_body_reaches_the_route(tiny_llava: Path) -> None:
    """Read in the middleware, replayed to the route: parsed and validated there (503: this app
    has no workers), the hold given back."""
    ctx = _context(tiny_llava)
    app = build_app(ctx, start_engine=False)
    payload = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    scope = _scope("sekret")
    scope["headers"] = [(k, str(len(payload)).encode() if k == b"content-length" else v) for k, v in scope["headers"]]
    parts = [payload[:10], payload[10:]]

    async def two_parts() -> dict[str, Any]:
        if parts:
            chunk = parts.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(parts)}
        return await _stalled()  # after the body: no disconnect while the app answers

    status, headers, body, _ = asyncio.run(_call(app, scope, two_parts))
    assert status == 503 and "warming" in body["error"]["message"] and headers["retry-after"] == "5"
    assert ctx.image_budget.reserved == 0


@pytest.mark.parametrize("key", ["sekret", "wrong"])
def test_refusals_here_are_counted(tiny_llava: Path, key: str) -> None:
    ctx = _context(tiny_llava)
    app = build_app(ctx, start_engine=False)
    status, *_ = asyncio.run(_call(app, _scope(key), _stalled))
    expected = 401 if key == "wrong" else 408
    assert status == expected
    metrics = TestClient(app).get("/metrics").text
    assert f'mm_serve_requests_total{{finish_reason="error",status_code="{expected}"}} 1.0' in metrics
    assert "mm_serve_image_bytes_in_flight 0.0" in metrics


def test_a_body_still_arriving_when_the_service_stops_gets_503_at_once(tiny_llava: Path) -> None:
    """SIGTERM's drain waits only for calls past their body; one still sending it is answered 503
    with the grace period's Retry-After within STOP_CHECK_S, not cut off by uvicorn's exit."""
    ctx = _context(tiny_llava)
    app = build_app(ctx, start_engine=False)

    async def drain_then_stall() -> dict[str, Any]:
        await asyncio.sleep(0.05)
        ctx.holder.drain_deadline = time.monotonic() + 7.0
        ctx.holder.draining.set()
        return await _stalled()

    status, headers, body, elapsed = asyncio.run(_call(app, _scope("sekret"), drain_then_stall))
    assert status == 503 and body["error"]["code"] == "service_unavailable" and "shutting down" in body["error"]["message"]
    assert headers["retry-after"] == "7" and headers["connection"] == "close"
    assert elapsed < 0.25 + 0.2 and ctx.image_budget.reserved == 0


def test_one_client_holds_at_most_a_quarter_of_the_budget_ahead_of_its_bytes(tiny_llava: Path) -> None:
    """Announced 600 KiB bodies, none sent: a client's first holds its Content-Length, its second
    (past 1 MiB of the 4 MiB budget) only what arrives, so trickling large announced bodies over
    fresh connections cannot keep the budget; another address holds its own share."""
    ctx = _context(tiny_llava)
    app = build_app(ctx, start_engine=False)
    seen: list[int] = []

    async def calls() -> list[tuple[int, dict[str, str], dict[str, Any], float]]:
        async def watch() -> dict[str, Any]:
            await asyncio.sleep(0.1)
            seen.append(ctx.image_budget.reserved)
            return await _stalled()

        scopes = [_scope("sekret", "10.0.0.1", 600 << 10), _scope("sekret", "10.0.0.1", 600 << 10),
                  _scope("sekret", "10.0.0.2", 600 << 10)]
        return await asyncio.gather(*(_call(app, scope, watch) for scope in scopes))

    answers = asyncio.run(calls())
    assert seen and max(seen) == 2 * (600 << 10)  # the first of 10.0.0.1 and the one of 10.0.0.2
    assert [a[0] for a in answers] == [408, 408, 408] and ctx.image_budget.reserved == 0
    assert not ctx_ahead(app)


def ctx_ahead(app: Any) -> dict[str, int]:
    """The body middleware's bytes held ahead, per client address (empty once every body ended)."""
    layer = app.middleware_stack
    while layer is not None and type(layer).__name__ != "BodyLimitMiddleware":
        layer = getattr(layer, "app", None)
    assert layer is not None
    return dict(layer._ahead._bytes)


@pytest.mark.parametrize("event", ["silence", "stop"])
def test_a_stalled_file_upload_gets_408_or_the_stopping_503(tiny_llava: Path, event: str) -> None:
    """``/v1/files`` bodies are streamed by the form parser, not read by the middleware: a wait for
    more of one still ends in 408 after api.body_idle_timeout_s, or in the stopping 503 (uvicorn
    would otherwise cut it with a plain-text 500 at exit)."""
    ctx = _context(tiny_llava)
    app = build_app(ctx, start_engine=False)
    scope = _scope("sekret", length=5000)
    scope["path"], scope["raw_path"] = "/v1/files", b"/v1/files"
    scope["headers"] = [(k, b"multipart/form-data; boundary=bbbb" if k == b"content-type" else v)
                        for k, v in scope["headers"]]
    sent: list[int] = []

    async def part_then_stall() -> dict[str, Any]:
        if not sent:
            sent.append(1)
            return {"type": "http.request", "body": b"--bbbb\r\n", "more_body": True}
        if event == "stop":
            ctx.holder.drain_deadline = time.monotonic() + 3.0
            ctx.holder.draining.set()
        return await _stalled()

    status, headers, body, elapsed = asyncio.run(_call(app, scope, part_then_stall))
    assert headers["connection"] == "close"
    if event == "silence":
        assert status == 408 and body["error"]["code"] == "body_timeout" and "8 bytes arrived" in body["error"]["message"]
        assert "api.body_read_timeout_s" not in body["error"]["message"] and 0.25 <= elapsed < 1.0
    else:
        assert status == 503 and headers["retry-after"] == "3" and elapsed < 0.5
