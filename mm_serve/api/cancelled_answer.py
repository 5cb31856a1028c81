"""A call cancelled before it was answered still gets OpenAI's error JSON, not uvicorn's plain-text 500."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from mm_serve.api.error_handlers import error_response
from mm_serve.api.sse import DONE, error_event
from mm_serve.protocol.errors import STOPPED_MESSAGE, STOPPED_RETRY_AFTER_S, unavailable

LAST_WORDS_S = 1.0  # seconds a stopped call's last answer may take to send (see _last_words)


class CancelledAnswerMiddleware:
    """Outermost ASGI middleware: when a call's task is cancelled before its response started (the service
    stopped at once, on a second SIGTERM / SIGINT or past uvicorn's graceful-shutdown wait, and the loop
    cancels what is left), it answers 503 ``service_unavailable`` with ``Retry-After``
    (:data:`~mm_serve.protocol.errors.STOPPED_RETRY_AFTER_S` seconds) and closes the connection; uvicorn would send a plain-text
    500. A stream already started (``text/event-stream``) gets that error as its last event, then
    ``data: [DONE]``, and ends, where it was cut with uvicorn's traceback of the cancelled task; another
    response already started is cut, as before. Either last answer gets :data:`LAST_WORDS_S` seconds: a
    client that stopped reading is dropped then, so that the process can exit."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = streaming = ended = False

        async def tracked(message: Any) -> None:
            nonlocal started, streaming, ended
            if message["type"] == "http.response.start":
                started = True
                streaming = any(name.lower() == b"content-type" and value.startswith(b"text/event-stream")
                                for name, value in message.get("headers", ()))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if started and streaming and not ended:
                last = error_event(STOPPED_MESSAGE) + DONE
                await _last_words(send({"type": "http.response.body", "body": last.encode(), "more_body": False}))
                return
            if started:
                raise
            response = error_response(unavailable(STOPPED_MESSAGE, STOPPED_RETRY_AFTER_S))
            response.headers["connection"] = "close"
            await _last_words(response(scope, receive, send))


async def _last_words(sending: Awaitable[None]) -> None:
    """Send a stopped call's last answer for at most :data:`LAST_WORDS_S` seconds: a client that does not read
    (its socket buffers full), or the loop's next cancel, must not keep the process from exiting. The
    connection is dropped then, quietly (the stop is not an error of the app's)."""
    try:
        await asyncio.wait_for(sending, LAST_WORDS_S)
    except (TimeoutError, asyncio.CancelledError, OSError):
        pass
