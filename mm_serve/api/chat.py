"""``POST /v1/chat/completions``: the call pipeline, then JSON or an SSE stream of chunks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request

from mm_serve.api.call_route import serve_call
from mm_serve.api.sse import DONE, error_event, event, failure_event
from mm_serve.pipeline.context import ServerContext
from mm_serve.pipeline.generation import Generation
from mm_serve.pipeline.pipeline import AdmittedCall
from mm_serve.pipeline.responses import finish_reason, timeout_message
from mm_serve.pipeline.tool_stream import ToolStream
from mm_serve.protocol.logprobs_format import chat_logprobs
from mm_serve.protocol.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    DeltaMessage,
    dump,
)
from mm_serve.protocol.service_tier import openai_tier


async def create_chat_completion(body: ChatCompletionRequest, raw: Request, ctx: ServerContext) -> object:
    """Admit the call, then answer as JSON or as an SSE stream (499 when the client left)."""
    return await serve_call(body, raw, ctx, _stream)


async def _stream(admitted: AdmittedCall, ctx: ServerContext, raw: Request, include_usage: bool) -> AsyncIterator[str]:
    gen: Generation = admitted.generations[0]
    tokenizer, top_n = ctx.holder.inputs.tokenizer, admitted.call.logprobs
    chunk = ChatCompletionChunk(id=f"chatcmpl-{gen.request_id}", created=int(time.time()),
                                model=ctx.served_model_name, choices=[], service_tier=openai_tier(admitted.call.tier))

    def emit(choices: list[ChatChunkChoice]) -> str:
        chunk.choices = choices
        payload = dump(chunk)
        if not include_usage:
            payload.pop("usage", None)
        return event(payload)

    sent_tokens = [0] * len(gen.states)
    closed = [False] * len(gen.states)
    calls = ToolStream(ctx, admitted.call, len(gen.states))
    try:
        opening = None if calls.forced else ""  # an answer that is a tool call has no content (OpenAI's null)
        yield emit([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=opening))
                    for i in range(len(gen.states))])
        async for i in gen.changes(ctx.deadline(), raw.is_disconnected):
            state = gen.states[i]
            if closed[i]:
                continue
            piece = state.take(sent_tokens[i])  # text, tokens and their log-probabilities of one moment
            if piece.finished and state.failure:
                yield failure_event(state)
                yield DONE
                return
            delta, reason = calls.step(i, piece.text, finish_reason(state.finish_reason) if piece.finished else None)
            if delta is None and not piece.finished:
                continue  # held: a tool call is read whole (its tokens go with the chunk that sends it)
            logprobs = None  # the log-probabilities of the tokens since the last chunk
            if top_n is not None and piece.token_ids:
                logprobs = chat_logprobs(tokenizer, piece.token_ids, piece.logprobs, top_n)
            sent_tokens[i] += len(piece.token_ids)
            closed[i] = piece.finished
            yield emit([ChatChunkChoice(index=i, delta=delta or DeltaMessage(), logprobs=logprobs,
                                        finish_reason=reason)])
        if include_usage:
            chunk.choices = []
            chunk.usage = gen.usage()
            yield event(dump(chunk))
        yield DONE
    except TimeoutError:
        yield error_event(timeout_message(ctx))
        yield DONE
    except ConnectionAbortedError:
        return
    finally:
        gen.abort()
