"""The non-streamed answer to an admitted call: wait for its requests, then build OpenAI's body.

The HTTP routes, Batch API rows and the caption job answer with exactly these bodies.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Literal

from mm_serve.engine.request_state import RequestState
from mm_serve.pipeline.context import ServerContext
from mm_serve.pipeline.generation import DEADLINE_PASSED
from mm_serve.pipeline.pipeline import AdmittedCall
from mm_serve.pipeline.tool_answer import answer_message
from mm_serve.protocol.errors import bad_request, counted, unavailable
from mm_serve.protocol.logprobs_format import chat_logprobs, completion_logprobs
from mm_serve.protocol.schemas import (
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)
from mm_serve.protocol.service_tier import openai_tier

FAILED_RETRY_AFTER_S = 1  # a request that failed (its workers lost or stopped): retry, on this server or another


def finish_reason(reason: str | None) -> Literal["stop", "length"] | None:
    """The OpenAI finish reason: ``stop`` or ``length``; anything else (abort, error) is None."""
    if reason == "stop":
        return "stop"
    return "length" if reason == "length" else None


def timeout_message(ctx: ServerContext) -> str:
    """What a call that ran past ``api.timeout_ms`` is told."""
    return f"the request did not finish within api.timeout_ms ({ctx.config.api.timeout_ms} ms)"


async def wait_all(ctx: ServerContext, admitted: AdmittedCall, gone: Callable[[], Awaitable[bool]],
                   deadline: float | None = None) -> None:
    """Wait until every request of the call has finished, by ``deadline`` (``time.monotonic()``
    seconds; default ``api.timeout_ms`` from now; ``math.inf``: no limit).

    Raises:
        APIError: 503 when the call runs past ``api.timeout_ms`` (its requests are aborted) or one
            of its requests failed.
        ConnectionAbortedError: the client went away (its requests are aborted).
    """
    deadline = ctx.deadline() if deadline is None else deadline
    try:
        for generation in admitted.generations:
            await generation.wait(deadline, gone)
    except TimeoutError:  # the requests end failed (counted as such), the other prompts' too
        admitted.abort(DEADLINE_PASSED)
        raise counted(unavailable(timeout_message(ctx))) from None
    except ConnectionAbortedError:
        admitted.abort()
        raise
    failed = next((state for g in admitted.generations if (state := g.failed()) is not None), None)
    if failed is not None and failed.invalid_input:  # what it asked cannot be done: sending it again would not help
        raise counted(bad_request(str(failed.failure_message), None, "invalid_grammar"))
    if failed is not None:
        raise counted(unavailable(str(failed.failure_message), FAILED_RETRY_AFTER_S))


def chat_response(ctx: ServerContext, admitted: AdmittedCall) -> ChatCompletionResponse:
    """The ``chat.completion`` body of a finished chat call."""
    generation, top_n = admitted.generations[0], admitted.call.logprobs
    tokenizer = ctx.holder.inputs.tokenizer
    choices = []
    for i, s in enumerate(generation.states):
        message, reason = answer_message(ctx, admitted.call, s.text, finish_reason(s.finish_reason))
        choices.append(ChatChoice(
            index=i, message=message, finish_reason=reason,
            logprobs=None if top_n is None else chat_logprobs(tokenizer, s.token_ids, s.logprobs, top_n)))
    return ChatCompletionResponse(model=ctx.served_model_name, choices=choices, usage=generation.usage(),
                                  service_tier=openai_tier(admitted.call.tier))


def completion_response(ctx: ServerContext, admitted: AdmittedCall) -> CompletionResponse:
    """The ``text_completion`` body of a finished completions call (choice ``p * n + i`` is copy ``i``
    of prompt ``p``)."""
    call, tokenizer = admitted.call, ctx.holder.inputs.tokenizer
    choices, prompt_tokens, completion_tokens, cached_tokens = [], 0, 0, 0
    for p, generation in enumerate(admitted.generations):
        prompt_tokens += generation.num_prompt_tokens
        cached_tokens += generation.cached_tokens
        echo = echo_text(ctx, admitted, p)
        for i, s in enumerate(generation.states):
            completion_tokens += len(s.token_ids)
            logprobs = None
            if call.logprobs is not None:
                logprobs = completion_logprobs(tokenizer, s.token_ids, s.logprobs, call.logprobs, len(echo),
                                               echo_logprobs(ctx, admitted, p, s, echo))
            choices.append(CompletionChoice(index=p * call.body.n + i, text=echo + s.text, logprobs=logprobs,
                                            finish_reason=finish_reason(s.finish_reason)))
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                  total_tokens=prompt_tokens + completion_tokens,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))
    return CompletionResponse(model=ctx.served_model_name, choices=choices, usage=usage,
                              service_tier=openai_tier(call.tier))


def echo_text(ctx: ServerContext, admitted: AdmittedCall, p: int) -> str:
    """The text a completions call with ``echo`` puts before prompt ``p``'s choices: the prompt as sent
    (token ids decoded, special tokens kept); "" without ``echo``."""
    if not getattr(admitted.call.body, "echo", None):
        return ""
    prompt = admitted.call.prompts[p]
    if "prompt" in prompt:
        return str(prompt["prompt"])
    return str(ctx.holder.inputs.tokenizer.decode(prompt["prompt_token_ids"]))


def echo_logprobs(ctx: ServerContext, admitted: AdmittedCall, p: int, state: RequestState,
                  echo: str) -> CompletionLogprobs | None:
    """The log-probabilities of prompt ``p``'s tokens (the first one's null) for a completions call with
    ``echo`` and ``logprobs`` (computed by the prefill pass: ``prompt_logprobs``), their offsets in ``echo``
    (its :func:`echo_text`); None without ``echo``."""
    call = admitted.call
    if not getattr(call.body, "echo", None) or call.logprobs is None:
        return None
    prompt_ids = admitted.generations[p].prompt_token_ids
    entries = state.prompt_logprobs or [None] * len(prompt_ids)
    out = completion_logprobs(ctx.holder.inputs.tokenizer, prompt_ids, entries, call.logprobs)
    out.text_offset = _aligned_offsets(out.tokens, echo)
    return out


def _aligned_offsets(tokens: list[str], text: str) -> list[int]:
    """Where each of ``tokens`` (their texts, one by one) starts in ``text``: found at the running position or
    one character on (a token decoded alone may drop its leading space); a token not there (a special token
    such as ``<s>``, which the text does not hold) is placed at the running position and takes no room."""
    offsets, at = [], 0
    for token in tokens:
        found = text.find(token, at, at + len(token) + 1) if token else -1
        offsets.append(found if found >= 0 else at)
        at = found + len(token) if found >= 0 else at
    return offsets


async def answer(ctx: ServerContext, admitted: AdmittedCall, gone: Callable[[], Awaitable[bool]],
                 deadline: float | None = None) -> ChatCompletionResponse | CompletionResponse:
    """Wait for the call (:func:`wait_all`, by ``deadline``), then its body.

    Raises:
        APIError: 503 past ``api.timeout_ms`` or for a failed request.
        ConnectionAbortedError: the client went away.
    """
    await wait_all(ctx, admitted, gone, deadline)
    if admitted.call.chat is not None:
        return chat_response(ctx, admitted)
    return completion_response(ctx, admitted)
