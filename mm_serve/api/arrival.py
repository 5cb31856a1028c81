"""The arrival of an HTTP call: stamped before its body is read, named by a request id, the phases of its
handling reported in ``Server-Timing``, and the call's origin as the pipeline takes it."""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

from fastapi import Request

from mm_serve.pipeline.origin import CallOrigin

Scope = dict[str, Any]
CLIENT_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,128}")  # a client's X-Request-Id that is echoed: visible ASCII


def request_id(scope: Scope) -> str:
    """The call's ``x-request-id``: the client's ``X-Request-Id`` when it sent one of at most 128 visible ASCII
    characters (vLLM's echo), else a fresh ``req_<32 hex digits>`` (OpenAI's form)."""
    for name, value in scope.get("headers", []):
        if name.lower() == b"x-request-id" and CLIENT_REQUEST_ID.fullmatch(value):
            return str(value.decode("ascii"))
    return f"req_{uuid.uuid4().hex}"


class ArrivalTimeMiddleware:
    """Stamps ``request.state.arrival`` (``time.monotonic()``) before the body is read, for TTFT,
    and reports the milliseconds from then to the response's start in a ``Server-Timing: app;dur=``
    header (W3C Server Timing): for a refusal the whole of its handling here, for a stream the
    time to its headers. A client that measures more has spent the rest outside the application
    (connection, HTTP parsing, its own event loop). The phases a handler marked on the way
    (:func:`mark_phase`) follow as more metrics, each the milliseconds since the previous mark:
    ``app;dur=41.0, parse;dur=2.1, precheck;dur=0.4, media;dur=37.9``. Every response carries the call's
    ``x-request-id`` (:func:`request_id`; also ``request.state.request_id``), which OpenAI's SDK reports as
    a response's ``_request_id``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrival = time.monotonic()
        state = scope.setdefault("state", {})
        state["arrival"] = arrival
        state["request_id"] = call_id = request_id(scope)
        phases: list[tuple[str, float]] = state.setdefault("phases", [])

        async def timed_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                metrics, since = [f"app;dur={1000.0 * (time.monotonic() - arrival):.1f}"], arrival
                for name, at in phases:
                    metrics.append(f"{name};dur={1000.0 * (at - since):.1f}")
                    since = at
                headers = list(message.get("headers", []))
                headers += [(b"server-timing", ", ".join(metrics).encode()), (b"x-request-id", call_id.encode())]
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


def release_body(request: Any) -> None:
    """Give back the bytes ``request``'s body holds in the image budget (:class:`BodyLimitMiddleware`),
    when the handler's own image reservation takes over. Nothing for a request that holds none."""
    release = getattr(request.state, "release_body", None)
    if release is not None:
        release()


def arrival_time(request: Any) -> float:
    """When the request reached the server (falls back to now)."""
    return float(getattr(request.state, "arrival", time.monotonic()))


def http_origin(request: Request) -> CallOrigin:
    """The :class:`CallOrigin` of an HTTP call: its stamped arrival, its phase marks, its body's hold
    on the image budget, its client's disconnect check, and its tenant (the API key it came with,
    set by the key check when ``api.cache_salt_by_api_key`` is on)."""
    return CallOrigin(arrival_time(request), lambda phase: mark_phase(request, phase),
                      lambda: release_body(request), request.is_disconnected,
                      getattr(request.state, "tenant", ""))
