"""A fake OpenAI-compatible streaming server of known capacity, on a real socket in a thread.

Requests go through one "prefill" slot, one at a time, for ``service_s`` seconds each
(so the capacity is ``1 / service_s`` requests/s); then the first content chunk is
sent, then the remaining ``max_tokens - 1`` tokens, ``itl_s`` apart (in one chunk when
``itl_s`` is 0), then the usage chunk and ``[DONE]``.

With ``prefix_cache=True`` it plays a server with a prefix cache, in whole messages:
each message is 10 prompt tokens; the cached tokens are 10 per leading message that
an earlier request had in the same place (at most all messages but the last); the
prefill wait shrinks to ``service_s * uncached / prompt``; the usage carries
``prompt_tokens_details.cached_tokens``, and ``/metrics`` the mm-serve cache counters
(the encoder cache counts a hit for every image part seen before).
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
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from mm_serve.bench.launch import free_port


def _event(payload: dict[str, object]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


TOKENS_PER_MESSAGE = 10


class _PrefixCache:
    """Whole-message prefix matching against every earlier request, and the counters it implies."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []
        self.images: set[str] = set()
        self.counters = {"queried": 0, "hits": 0, "encoder_hits": 0, "encoder_misses": 0}

    def lookup(self, messages: list[dict[str, object]]) -> tuple[int, int]:
        """(prompt tokens, cached tokens) of a request, remembered for the next ones."""
        keys = [json.dumps(m, sort_keys=True) for m in messages]
        best = 0
        for old in self.seen:
            n = 0
            while n < min(len(old), len(keys) - 1) and old[n] == keys[n]:
                n += 1
            best = max(best, n)
        self.seen.append(keys)
        for m in messages:
            for part in m["content"] if isinstance(m["content"], list) else ():
                if part.get("type") == "image_url":
                    url = part["image_url"]["url"]
                    self.counters["encoder_hits" if url in self.images else "encoder_misses"] += 1
                    self.images.add(url)
        prompt, cached = TOKENS_PER_MESSAGE * len(keys), TOKENS_PER_MESSAGE * best
        self.counters["queried"] += prompt
        self.counters["hits"] += cached
        return prompt, cached

    def metrics(self) -> str:
        c = self.counters
        return "\n".join([
            "# TYPE mm_serve_prefix_cache_queried_tokens_total counter",
            f"mm_serve_prefix_cache_queried_tokens_total {c['queried']}.0",
            f'mm_serve_prefix_cache_hit_tokens_total{{worker="0"}} {c["hits"]}.0',
            f"mm_serve_encoder_cache_hits_total {c['encoder_hits']}.0",
            f"mm_serve_encoder_cache_misses_total {c['encoder_misses']}.0", ""])


def build_app(service_s: float, itl_s: float = 0.0, status: int = 200, prefix_cache: bool = False,
              warming_checks: int = 0) -> FastAPI:
    """The fake app; every request gets ``status`` (an error body unless 200). With ``warming_checks`` it has a
    ``/health`` that answers 503 that many times (a server warming up), then 200."""
    app = FastAPI()
    slot = asyncio.Lock()
    app.state.bodies = []
    app.state.api_key = None  # set: /v1/models wants it as a bearer key
    cache = _PrefixCache() if prefix_cache else None

    if cache is not None:
        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            return PlainTextResponse(cache.metrics())

    if warming_checks:
        app.state.health_checks = 0

        @app.get("/health")
        async def health() -> JSONResponse:
            app.state.health_checks += 1
            warm = app.state.health_checks > warming_checks
            return JSONResponse({"status": "ok" if warm else "warming"}, status_code=200 if warm else 503)

    @app.get("/v1/models")
    async def models(request: Request) -> object:
        if app.state.api_key and request.headers.get("authorization") != f"Bearer {app.state.api_key}":
            return JSONResponse({"error": {"message": "invalid API key"}}, status_code=401)
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> object:
        body = await request.json()
        app.state.bodies.append(body)
        if status != 200:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=status)
        n = int(body["max_tokens"])
        prompt, cached = cache.lookup(body["messages"]) if cache is not None else (7, 0)
        usage: dict[str, object] = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
        if cache is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}

        async def stream() -> AsyncIterator[str]:
            async with slot:
                await asyncio.sleep(service_s * (prompt - cached) / prompt)
            yield _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            yield _event({"choices": [{"index": 0, "delta": {"content": "a"}}]})
            if itl_s > 0:
                for _ in range(n - 1):
                    await asyncio.sleep(itl_s)
                    yield _event({"choices": [{"index": 0, "delta": {"content": " b"}}]})
            elif n > 1:
                yield _event({"choices": [{"index": 0, "delta": {"content": " b" * (n - 1)}}]})
            yield _event({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


class FakeServer:
    """Runs :func:`build_app` under uvicorn in a daemon thread; a context manager."""

    def __init__(self, service_s: float, itl_s: float = 0.0, status: int = 200,
                 prefix_cache: bool = False, warming_checks: int = 0) -> None:
        self.app = build_app(service_s, itl_s, status, prefix_cache, warming_checks)
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
