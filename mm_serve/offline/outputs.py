"""Results returned by the offline :class:`mm_serve.LLM` API."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" or "length"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob}, chosen token first


@dataclass
class RequestOutput:
    """All outputs of one request; ``text``/``token_ids``/``finish_reason`` mirror ``outputs[0]``."""

    request_id: str
    num_prompt_tokens: int  # image tokens included
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (first completion's prefill)
    # with SamplingParams.prompt_logprobs: per prompt token, {token id: log-probability} (None for the first)
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason
