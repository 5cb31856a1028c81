"""OpenAI batch rows on the in-process engine, answered as ``mm-serve serve`` would answer them.

The body is validated with the API's own schema (:class:`ChatCompletionRequest`),
its images are loaded with the API's media rules (``api.*`` of the config: data
URIs always; ``file://`` only under ``api.allowed_local_media_path``), and its
sampling parameters are mapped by the API's :func:`sampling_params`. The response
body is the ``chat.completion`` the server would send; a request the server would
refuse gets the server's status code and error body.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Literal

from pydantic import ValidationError

from mm_serve.api.errors import APIError, bad_request, unavailable
from mm_serve.api.logprobs_format import chat_logprobs
from mm_serve.api.request_builder import chat_messages, process_inputs, sampling_params
from mm_serve.api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Usage,
    dump,
)
from mm_serve.caption.engine_requests import raise_if_engine_down, submit_all, wait_finished
from mm_serve.caption.inputs import CaptionInput
from mm_serve.caption.records import Outcome
from mm_serve.engine.engine_client import EngineClient
from mm_serve.engine.request_state import RequestState
from mm_serve.inputs.input_processor import InvalidRequestError


class EngineBatchRequests:
    """Runs chat-completion request bodies on an engine client.

    Args:
        client: a started engine client (not owned).
        model_name: the ``model`` of bodies that name none, and of the responses.
    """

    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name
        self.context_len = client.context_limit

    async def run(self, item: CaptionInput, start: float) -> Outcome:
        """Answer the body of ``item``; ``start`` is the input's ``time.perf_counter()`` start.

        Raises:
            FatalBackendError: the engine went down.
        """
        body: dict[str, Any] = {"model": self.model_name, **(item.body or {}), "stream": False}
        api = self.client.config.api
        try:
            request = ChatCompletionRequest.model_validate(body)
            messages = await chat_messages(request.messages, api)
            inputs = await process_inputs(self.client.inputs, {"messages": messages}, api.max_request_length)
            top_n = request.top_logprobs or 0
            params = sampling_params(request, len(inputs.prompt_token_ids), self.context_len,
                                     top_n if request.logprobs else None, self.client.model_config.text.vocab_size)
            per_choice = [replace(params, n=1, seed=None if params.seed is None else params.seed + i)
                          for i in range(params.n)]
            states = submit_all(self.client, inputs, per_choice)
        except ValidationError as exc:
            return _refused(start, bad_request(_validation_text(exc)))
        except InvalidRequestError as exc:
            return _refused(start, bad_request(str(exc), "messages", "context_length_exceeded"))
        except APIError as exc:
            return _refused(start, exc)
        await wait_finished(self.client, states)
        raise_if_engine_down(self.client, states)
        failed = next((s.error for s in states if s.error), None)
        if failed:
            return _refused(start, unavailable(f"the request failed: {failed}"))
        response = self._response(request, states, len(inputs.prompt_token_ids), top_n)
        payload = dump(response)
        return Outcome(
            latency_s=time.perf_counter() - start, caption=states[0].text.strip(),
            prompt_tokens=response.usage.prompt_tokens, completion_tokens=response.usage.completion_tokens,
            status_code=200, body=payload, request_id=response.id,
        )

    def _response(self, request: ChatCompletionRequest, states: list[RequestState], prompt_tokens: int,
                  top_n: int) -> ChatCompletionResponse:
        tokenizer = self.client.inputs.tokenizer
        choices = [
            ChatChoice(
                index=i, message=AssistantMessage(content=s.text),
                finish_reason=_finish_reason(s.finish_reason),
                logprobs=chat_logprobs(tokenizer, s.token_ids, s.logprobs, top_n) if request.logprobs else None,
            )
            for i, s in enumerate(states)
        ]
        completion = sum(len(s.token_ids) for s in states)
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)
        return ChatCompletionResponse(model=request.model, choices=choices, usage=usage)


def _finish_reason(reason: str | None) -> Literal["stop", "length"] | None:
    """The OpenAI finish reason: ``stop`` or ``length``; anything else (abort, error) is None."""
    if reason == "stop":
        return "stop"
    return "length" if reason == "length" else None


def _validation_text(exc: ValidationError) -> str:
    """The first schema error as the API words it: ``<message> at '<field>'``."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    return f"{first.get('msg', 'invalid value')} at '{where}'" if where else str(first.get("msg"))


def _refused(start: float, exc: APIError) -> Outcome:
    """A failure carrying the status code and OpenAI error body the server would send."""
    body = {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}
    return Outcome(
        latency_s=time.perf_counter() - start, error=exc.message, error_code=exc.code or exc.type,
        status_code=exc.status, body=body,
    )
