"""``POST /v1/completions``: raw-prompt completions (text-only prompts), non-streamed and streamed."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from mm_serve.api.admission_gate import (
    DEFAULT_PRECHECK_TOKENS,
    admit_call,
    check_call_work,
    counted,
    hold_call,
    media_size,
    precheck_call,
    prediction_header,
)
from mm_serve.api.body_limit import arrival_time, mark_phase, release_body
from mm_serve.api.context import ServerContext
from mm_serve.api.decision_deadline import within_deadline
from mm_serve.api.errors import bad_request, unavailable
from mm_serve.api.generation import Generation
from mm_serve.api.logprobs_format import completion_logprobs
from mm_serve.api.request_builder import check_model, process_inputs, sampling_params
from mm_serve.api.schemas import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
    dump,
)
from mm_serve.api.sse import DONE, error_event, event
from mm_serve.api.tier_param import request_tier
from mm_serve.inputs.input_processor import ProcessedInputs


def _prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    if all(isinstance(p, str) for p in prompt):
        return [{"prompt": p} for p in prompt]
    return [{"prompt_token_ids": list(p)} for p in prompt]  # type: ignore[arg-type]


def _finish(reason: str | None) -> str | None:
    return reason if reason in ("stop", "length") else None


async def create_completion(body: CompletionRequest, raw: Request, ctx: ServerContext) -> object:
    """Validate, submit ``n`` requests per prompt, answer as JSON or SSE."""
    arrival = arrival_time(raw)
    mark_phase(raw, "parse")  # the body read, parsed and validated
    check_model(body.model, ctx.served_model_name, str(ctx.holder.model_dir))
    tier = request_tier(body.service_tier, ctx.config.slo)
    ctx.refuse_if_draining()
    prompts = _prompts(body.prompt)
    if len(prompts) > 64:
        raise bad_request(f"{len(prompts)} prompts in one request; the limit is 64", "prompt")
    if body.stream and len(prompts) > 1:
        raise bad_request("streaming supports one prompt per request", "prompt")
    recheck = precheck_call(ctx, tier, body.max_tokens or DEFAULT_PRECHECK_TOKENS, (), arrival)
    mark_phase(raw, "precheck")

    async def media() -> list[ProcessedInputs]:
        release_body(raw)  # parsed: the body's bytes stop counting against the image budget
        return [await process_inputs(ctx.holder.inputs, request, ctx.config.api.max_request_length)
                for request in prompts]

    with counted(ctx, tier):
        processed, committed = await within_deadline(media(), ctx.decision_deadline(arrival, tier), recheck,
                                                      ctx.media_load, media_size(prompts=len(prompts)))
    prepared = [(inputs, sampling_params(body, len(inputs.prompt_token_ids), ctx.context_len, body.logprobs,
                                         ctx.holder.model_config.text.vocab_size)) for inputs in processed]
    mark_phase(raw, "media")  # the prompts (and images) processed and tokenized
    with counted(ctx, tier):
        check_call_work(ctx.config, prepared)
    client = ctx.client_or_503()
    try:
        await hold_call(ctx, client, tier, prepared, raw.is_disconnected)
    except ConnectionAbortedError:
        return JSONResponse({}, status_code=499)
    mark_phase(raw, "hold")
    predicted = admit_call(ctx, client, tier, prepared, arrival, committed)
    mark_phase(raw, "admit")
    gens: list[Generation] = []
    try:
        for k, (inputs, params) in enumerate(prepared):  # the prediction is of the first prompt's first copy
            gens.append(Generation(client, inputs, params, arrival, tier, predicted if k == 0 else None))
    except BaseException:
        for gen in gens:
            gen.abort()
        raise
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(gens[0], body, ctx, raw, include_usage), media_type="text/event-stream",
                                 headers=prediction_header(predicted))
    try:
        for gen in gens:
            await gen.wait(ctx.deadline(), raw.is_disconnected)
    except TimeoutError:
        raise unavailable(f"the request did not finish within api.timeout_ms ({ctx.config.api.timeout_ms} ms)") from None
    except ConnectionAbortedError:
        for gen in gens:
            gen.abort()
        return JSONResponse({}, status_code=499)
    tokenizer = ctx.holder.inputs.tokenizer
    choices, prompt_tokens, completion_tokens, cached_tokens = [], 0, 0, 0
    for p, gen in enumerate(gens):
        failure = gen.failure()
        if failure:
            raise unavailable(f"the request failed: {failure}")
        prompt_tokens += gen.num_prompt_tokens
        cached_tokens += gen.cached_tokens
        for i, s in enumerate(gen.states):
            completion_tokens += len(s.token_ids)
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(tokenizer, s.token_ids, s.logprobs, body.logprobs)
            choices.append(CompletionChoice(index=p * body.n + i, text=s.text, logprobs=logprobs,
                                            finish_reason=_finish(s.finish_reason)))
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                  total_tokens=prompt_tokens + completion_tokens,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))
    return CompletionResponse(model=ctx.served_model_name, choices=choices, usage=usage, service_tier=tier.name)


async def _stream(gen: Generation, body: CompletionRequest, ctx: ServerContext, raw: Request,
                  include_usage: bool) -> AsyncIterator[str]:
    base = {"id": f"cmpl-{gen.request_id}", "object": "text_completion", "created": int(time.time()),
            "model": ctx.served_model_name, "service_tier": None if gen.tier is None else gen.tier.name}
    closed = [False] * len(gen.states)
    try:
        async for i in gen.changes(ctx.deadline(), raw.is_disconnected):
            state = gen.states[i]
            if closed[i]:
                continue
            text = state.take_text()
            if state.finished and state.error and state.error != "aborted":
                yield error_event(f"the request failed: {state.error}")
                yield DONE
                return
            if state.finished:
                closed[i] = True
            if text or state.finished:
                choice = {"index": i, "text": text, "logprobs": None,
                          "finish_reason": _finish(state.finish_reason) if state.finished else None}
                yield event({**base, "choices": [choice], **({"usage": None} if include_usage else {})})
        if include_usage:
            yield event({**base, "choices": [], "usage": dump(gen.usage())})
        yield DONE
    except TimeoutError:
        yield error_event(f"the request did not finish within api.timeout_ms ({ctx.config.api.timeout_ms} ms)")
        yield DONE
    except ConnectionAbortedError:
        return
    finally:
        gen.abort()
