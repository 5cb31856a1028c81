"""A fake OpenAI-compatible streaming server of known capacity, on a real socket in a thread.

Requests go through one "prefill" slot, one at a time, for ``service_s`` seconds each
(so the capacity is ``1 / service_s`` requests/s); then the first content chunk is
sent, then the remaining ``max_tokens - 1`` tokens, ``itl_s`` apart (in one chunk when
``itl_s`` is 0), then the usage chunk and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from types import TracebackType

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mm_serve.bench.launch import free_port


def _event(payload: dict[str, object]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def build_app(service_s: float, itl_s: float = 0.0, status: int = 200) -> FastAPI:
    """The fake app; every request gets ``status`` (an error body unless 200)."""
    app = FastAPI()
    slot = asyncio.Lock()
    app.state.bodies = []

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> object:
        body = await request.json()
        app.state.bodies.append(body)
        if status != 200:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=status)
        n = int(body["max_tokens"])

        async def stream() -> AsyncIterator[str]:
            async with slot:
                await asyncio.sleep(service_s)
            yield _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            yield _event({"choices": [{"index": 0, "delta": {"content": "a"}}]})
            if itl_s > 0:
                for _ in range(n - 1):
                    await asyncio.sleep(itl_s)
                    yield _event({"choices": [{"index": 0, "delta": {"content": " b"}}]})
            elif n > 1:
                yield _event({"choices": [{"index": 0, "delta": {"content": " b" * (n - 1)}}]})
            yield _event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n,
                                                   "total_tokens": 7 + n}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


class FakeServer:
    """Runs :func:`build_app` under uvicorn in a daemon thread; a context manager."""

    def __init__(self, service_s: float, itl_s: float = 0.0, status: int = 200) -> None:
        self.app = build_app(service_s, itl_s, status)
        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="error"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> FakeServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._server.should_exit = True
        self._thread.join(10)
