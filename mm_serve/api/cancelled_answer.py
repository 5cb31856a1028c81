"""A call cancelled before it was answered still gets OpenAI's error JSON, not uvicorn's plain-text 500."""

from __future__ import annotations

import asyncio
from typing import Any

from mm_serve.api.error_handlers import error_response
from mm_serve.protocol.errors import unavailable

STOPPED_RETRY_AFTER_S = 1


class CancelledAnswerMiddleware:
    """Outermost ASGI middleware: when a call's task is cancelled before its response started (the service
    stopped at once, on a second SIGTERM / SIGINT or past uvicorn's graceful-shutdown wait, and the loop
    cancels what is left), it answers 503 ``service_unavailable`` with ``Retry-After``
    (:data:`STOPPED_RETRY_AFTER_S` seconds) and closes the connection; uvicorn would send a plain-text
    500. A response already started (a stream) just ends, as before."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if started:
                raise
            response = error_response(unavailable("the service stopped before this request was answered; send it "
                                                  "again", STOPPED_RETRY_AFTER_S))
            response.headers["connection"] = "close"
            await response(scope, receive, send)
