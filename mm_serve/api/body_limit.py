"""ASGI middlewares: refuse bodies over ``max_body_bytes`` with 413 before parsing; stamp arrival time."""

from __future__ import annotations

import json
import time
from typing import Any

Scope = dict[str, Any]


class BodyLimitMiddleware:
    """Checks ``Content-Length`` up front; a body without one (chunked) is read here first,
    counted as it arrives, and refused with 413 as soon as it passes the limit.

    ``path_limits`` maps a path to its own ``(limit in bytes, config key named in the 413)``
    (file uploads); every other path has ``max_body_bytes`` (``api.max_body_bytes``)."""

    def __init__(self, app: Any, max_body_bytes: int, path_limits: dict[str, tuple[int, str]] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.path_limits = dict(path_limits or {})

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, key = self.path_limits.get(scope.get("path", ""), (self.max_body_bytes, "api.max_body_bytes"))
        length = next((value for name, value in scope.get("headers", []) if name == b"content-length"), None)
        if length is not None:
            if length.isdigit() and int(length) > limit:
                await self._reject(send, limit, key)
                return
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > limit:
                await self._reject(send, limit, key)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: wait for a disconnect, as the server would

        await self.app(scope, replay, send)

    async def _reject(self, send: Any, limit: int, key: str) -> None:
        body = json.dumps({"error": {
            "message": f"request body is larger than the limit of {limit} bytes ({key})",
            "type": "invalid_request_error", "param": None, "code": "request_too_large",
        }}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class ArrivalTimeMiddleware:
    """Stamps ``request.state.arrival`` (``time.monotonic()``) before the body is read, for TTFT,
    and reports the milliseconds from then to the response's start in a ``Server-Timing: app;dur=``
    header (W3C Server Timing): for a refusal the whole of its handling here, for a stream the
    time to its headers. A client that measures more has spent the rest outside the application
    (connection, HTTP parsing, its own event loop). The phases a handler marked on the way
    (:func:`mark_phase`) follow as more metrics, each the milliseconds since the previous mark:
    ``app;dur=41.0, parse;dur=2.1, precheck;dur=0.4, media;dur=37.9``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrival = time.monotonic()
        state = scope.setdefault("state", {})
        state["arrival"] = arrival
        phases: list[tuple[str, float]] = state.setdefault("phases", [])

        async def timed_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                metrics, since = [f"app;dur={1000.0 * (time.monotonic() - arrival):.1f}"], arrival
                for name, at in phases:
                    metrics.append(f"{name};dur={1000.0 * (at - since):.1f}")
                    since = at
                headers = list(message.get("headers", []))
                headers.append((b"server-timing", ", ".join(metrics).encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, timed_send)


def mark_phase(request: Any, name: str) -> None:
    """Mark the end of phase ``name`` (a token: letters, digits, ``_``) of handling ``request`` now:
    reported in its ``Server-Timing`` header as the milliseconds since the previous mark (or its
    arrival). Nothing for a request that did not pass :class:`ArrivalTimeMiddleware`."""
    phases = getattr(request.state, "phases", None)
    if phases is not None:
        phases.append((name, time.monotonic()))


def arrival_time(request: Any) -> float:
    """When the request reached the server (falls back to now)."""
    return float(getattr(request.state, "arrival", time.monotonic()))
