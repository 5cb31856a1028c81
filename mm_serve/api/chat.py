"""``POST /v1/chat/completions``: non-streamed and streamed (SSE) chat completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from mm_serve.api.admission_gate import (
    DEFAULT_PRECHECK_TOKENS,
    admit_call,
    check_call_work,
    counted,
    declared_images,
    hold_call,
    hold_images,
    media_size,
    precheck_call,
    prediction_header,
)
from mm_serve.api.body_limit import arrival_time, mark_phase, release_body
from mm_serve.api.context import ServerContext
from mm_serve.api.decision_deadline import within_deadline
from mm_serve.api.errors import unavailable
from mm_serve.api.generation import Generation
from mm_serve.api.logprobs_format import chat_logprobs
from mm_serve.api.request_builder import chat_messages, check_model, process_inputs, sampling_params
from mm_serve.api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeltaMessage,
    dump,
)
from mm_serve.api.sse import DONE, error_event, event
from mm_serve.api.tier_param import request_tier
from mm_serve.inputs.input_processor import ProcessedInputs


def _finish(reason: str | None) -> str | None:
    return reason if reason in ("stop", "length") else None


async def create_chat_completion(body: ChatCompletionRequest, raw: Request, ctx: ServerContext) -> object:
    """Validate, submit ``n`` requests, and answer as JSON or as an SSE stream."""
    arrival = arrival_time(raw)
    mark_phase(raw, "parse")  # the body read, parsed and validated
    check_model(body.model, ctx.served_model_name, str(ctx.holder.model_dir))
    tier = request_tier(body.service_tier, ctx.config.slo)
    ctx.refuse_if_draining()
    recheck = precheck_call(ctx, tier, body.max_completion_tokens or body.max_tokens or DEFAULT_PRECHECK_TOKENS,
                            body.messages, arrival)
    mark_phase(raw, "precheck")

    images = declared_images(body.messages)

    async def media() -> ProcessedInputs:
        release_body(raw)  # the images' own reservation takes over from the body's
        with hold_images(ctx.image_budget, body.messages, ctx.config, images):
            messages = await chat_messages(body.messages, ctx.config.api)
            return await process_inputs(ctx.holder.inputs, {"messages": messages}, ctx.config.api.max_request_length)

    with counted(ctx, tier):
        inputs, committed = await within_deadline(media(), ctx.decision_deadline(arrival, tier), recheck,
                                                      ctx.media_load, media_size(images))
    mark_phase(raw, "media")  # images fetched and decoded, the prompt templated and tokenized
    top_n = body.top_logprobs or 0
    params = sampling_params(body, len(inputs.prompt_token_ids), ctx.context_len, top_n if body.logprobs else None,
                             ctx.holder.model_config.text.vocab_size)
    with counted(ctx, tier):
        check_call_work(ctx.config, [(inputs, params)])
    client = ctx.client_or_503()
    try:
        await hold_call(ctx, client, tier, [(inputs, params)], raw.is_disconnected)
    except ConnectionAbortedError:
        return JSONResponse({}, status_code=499)
    mark_phase(raw, "hold")
    predicted = admit_call(ctx, client, tier, [(inputs, params)], arrival, committed)
    mark_phase(raw, "admit")
    gen = Generation(client, inputs, params, arrival, tier, predicted)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(gen, body, ctx, raw, include_usage), media_type="text/event-stream",
                                 headers=prediction_header(predicted))
    try:
        await gen.wait(ctx.deadline(), raw.is_disconnected)
    except TimeoutError:
        raise unavailable(f"the request did not finish within api.timeout_ms ({ctx.config.api.timeout_ms} ms)") from None
    except ConnectionAbortedError:
        return JSONResponse({}, status_code=499)
    failure = gen.failure()
    if failure:
        raise unavailable(f"the request failed: {failure}")
    tokenizer = ctx.holder.inputs.tokenizer
    choices = [
        ChatChoice(
            index=i, message=AssistantMessage(content=s.text), finish_reason=_finish(s.finish_reason),
            logprobs=chat_logprobs(tokenizer, s.token_ids, s.logprobs, top_n) if body.logprobs else None,
        )
        for i, s in enumerate(gen.states)
    ]
    return ChatCompletionResponse(model=ctx.served_model_name, choices=choices, usage=gen.usage(),
                                  service_tier=tier.name)


async def _stream(gen: Generation, body: ChatCompletionRequest, ctx: ServerContext, raw: Request,
                  include_usage: bool) -> AsyncIterator[str]:
    tokenizer = ctx.holder.inputs.tokenizer
    chunk = ChatCompletionChunk(id=f"chatcmpl-{gen.request_id}", created=int(time.time()),
                                model=ctx.served_model_name, choices=[],
                                service_tier=None if gen.tier is None else gen.tier.name)

    def emit(choices: list[ChatChunkChoice]) -> str:
        chunk.choices = choices
        payload = dump(chunk)
        if not include_usage:
            payload.pop("usage", None)
        return event(payload)

    top_n = body.top_logprobs or 0
    sent_tokens = [0] * len(gen.states)
    closed = [False] * len(gen.states)
    try:
        yield emit([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                    for i in range(len(gen.states))])
        async for i in gen.changes(ctx.deadline(), raw.is_disconnected):
            state = gen.states[i]
            if closed[i]:
                continue
            text = state.take_text()
            new_tokens = state.token_ids[sent_tokens[i]:]
            logprobs = None
            if body.logprobs and new_tokens:
                logprobs = chat_logprobs(tokenizer, new_tokens, state.logprobs[sent_tokens[i]:], top_n)
            sent_tokens[i] = len(state.token_ids)
            if state.finished:
                if state.error and state.error != "aborted":
                    yield error_event(f"the request failed: {state.error}")
                    yield DONE
                    return
                closed[i] = True
                yield emit([ChatChunkChoice(index=i, delta=DeltaMessage(content=text or None), logprobs=logprobs,
                                            finish_reason=_finish(state.finish_reason))])
            elif text:
                yield emit([ChatChunkChoice(index=i, delta=DeltaMessage(content=text), logprobs=logprobs)])
        if include_usage:
            chunk.choices = []
            chunk.usage = gen.usage()
            yield event(dump(chunk))
        yield DONE
    except TimeoutError:
        yield error_event(f"the request did not finish within api.timeout_ms ({ctx.config.api.timeout_ms} ms)")
        yield DONE
    except ConnectionAbortedError:
        return
    finally:
        gen.abort()
