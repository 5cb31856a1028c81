"""``POST /v1/completions``: raw-prompt completions (text-only prompts); the call pipeline, then
JSON or an SSE stream."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request

from mm_serve.api.call_route import serve_call
from mm_serve.api.sse import DONE, error_event, event, failure_event
from mm_serve.pipeline.context import ServerContext
from mm_serve.pipeline.pipeline import AdmittedCall
from mm_serve.pipeline.responses import echo_logprobs, echo_text, finish_reason, timeout_message
from mm_serve.protocol.logprobs_format import completion_logprobs
from mm_serve.protocol.schemas import CompletionRequest, dump
from mm_serve.protocol.service_tier import openai_tier


async def create_completion(body: CompletionRequest, raw: Request, ctx: ServerContext) -> object:
    """Admit the call, then answer as JSON or as an SSE stream (499 when the client left)."""
    return await serve_call(body, raw, ctx, _stream)


async def _stream(admitted: AdmittedCall, ctx: ServerContext, raw: Request, include_usage: bool) -> AsyncIterator[str]:
    gen = admitted.generations[0]  # a stream has one prompt
    base = {"id": f"cmpl-{gen.request_id}", "object": "text_completion", "created": int(time.time()),
            "model": ctx.served_model_name, "service_tier": openai_tier(admitted.call.tier)}
    closed = [False] * len(gen.states)
    sent_tokens, offsets = [0] * len(gen.states), [0] * len(gen.states)
    tokenizer, top_n = ctx.holder.inputs.tokenizer, admitted.call.logprobs
    echo, echoed = echo_text(ctx, admitted, 0), [False] * len(gen.states)
    try:
        async for i in gen.changes(ctx.deadline(), raw.is_disconnected):
            state = gen.states[i]
            if closed[i]:
                continue
            piece = state.take(sent_tokens[i])  # text, tokens and their log-probabilities of one moment
            text = piece.text
            if piece.finished and state.failure:
                yield failure_event(state)
                yield DONE
                return
            if piece.finished:
                closed[i] = True
            if text or piece.finished:
                logprobs, before = None, None
                if not echoed[i]:  # the prompt goes first, in the choice's first chunk
                    echoed[i], text, offsets[i] = True, echo + text, len(echo)
                    before = echo_logprobs(ctx, admitted, 0, state, echo)
                new_tokens = piece.token_ids  # the tokens since the last chunk
                if top_n is not None and (new_tokens or before is not None):
                    part = completion_logprobs(tokenizer, new_tokens, piece.logprobs, top_n, offsets[i], before)
                    offsets[i] += sum(len(token) for token in part.tokens[len(part.tokens) - len(new_tokens):])
                    logprobs = dump(part)
                sent_tokens[i] += len(new_tokens)
                choice = {"index": i, "text": text, "logprobs": logprobs,
                          "finish_reason": finish_reason(state.finish_reason) if piece.finished else None}
                yield event({**base, "choices": [choice], **({"usage": None} if include_usage else {})})
        if include_usage:
            yield event({**base, "choices": [], "usage": dump(gen.usage())})
        yield DONE
    except TimeoutError:
        yield error_event(timeout_message(ctx))
        yield DONE
    except ConnectionAbortedError:
        return
    finally:
        gen.abort()
