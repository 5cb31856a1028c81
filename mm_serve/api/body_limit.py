"""ASGI middlewares: refuse bodies over ``max_body_bytes`` with 413 before parsing; stamp arrival time."""

from __future__ import annotations

import json
import time
from typing import Any

Scope = dict[str, Any]


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Checks ``Content-Length`` up front and counts streamed (chunked) bodies as they arrive."""

    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                await self._reject(send)
                return
        seen = 0
        started = False

        async def limited_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge
            return message

        async def tracking_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._reject(send)

    async def _reject(self, send: Any) -> None:
        body = json.dumps({"error": {
            "message": f"request body is larger than the limit of {self.max_body_bytes} bytes (api.max_body_bytes)",
            "type": "invalid_request_error", "param": None, "code": "request_too_large",
        }}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class ArrivalTimeMiddleware:
    """Stamps ``request.state.arrival`` (``time.monotonic()``) before the body is read, for TTFT."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrival"] = time.monotonic()
        await self.app(scope, receive, send)


def arrival_time(request: Any) -> float:
    """When the request reached the server (falls back to now)."""
    return float(getattr(request.state, "arrival", time.monotonic()))
