"""What both generation routes do with a call: the pipeline, then JSON or an SSE stream."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from mm_serve.api.arrival import http_origin
from mm_serve.api.sse import prediction_header
from mm_serve.pipeline.call import Body
from mm_serve.pipeline.context import ServerContext
from mm_serve.pipeline.pipeline import AdmittedCall, admit_call
from mm_serve.pipeline.responses import answer

StreamFn = Callable[[AdmittedCall, ServerContext, Request, bool], AsyncIterator[str]]


async def serve_call(body: Body, raw: Request, ctx: ServerContext, stream: StreamFn) -> object:
    """Admit ``body`` (:func:`~mm_serve.pipeline.pipeline.admit_call`), then answer with its JSON body,
    or, with ``stream: true``, with ``stream(admitted, ctx, raw, include_usage)`` as SSE (the
    prediction in its headers); 499 (no body) when the client left first."""
    try:
        admitted = await admit_call(ctx, body, http_origin(raw))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream(admitted, ctx, raw, include_usage), media_type="text/event-stream",
                                     headers=prediction_header(admitted.prediction))
        return await answer(ctx, admitted, raw.is_disconnected)
    except ConnectionAbortedError:
        return JSONResponse({}, status_code=499)
