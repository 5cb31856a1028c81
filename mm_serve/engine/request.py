"""The request object that moves through the schedulers (no tensors inside except the kept image embeddings)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mm_serve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class RequestStatus(enum.IntEnum):
    """Ordered so that ``status >= FINISHED_STOPPED`` means finished."""

    WAITING = 0  # queued for prefill (new, or preempted and awaiting recompute)
    RUNNING = 1  # has KV pages, decoding
    PREEMPTED = 2  # pages taken back; will be recomputed
    FINISHED_STOPPED = 3  # EOS, stop token or stop string
    FINISHED_LENGTH = 4  # max_tokens or context length reached
    FINISHED_ABORTED = 5  # cancelled by the client or the service

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


@dataclass
class Request:
    """One generation: prompt ids (image placeholders already expanded), outputs and KV pages.

    ``image_embeds`` (projected patch embeddings ``[num_image_tokens_total, hidden]``)
    is kept for the whole life of the request so a preempted request is
    recomputed from token ids plus embeddings, without re-running the vision encoder.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    num_images: int = 0
    pixel_values: torch.Tensor | None = None  # [num_images, 3, H, W] until encoded
    image_embeds: torch.Tensor | None = None  # [num_image_tokens_total, hidden] once encoded
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_reason: int | str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def needs_encoding(self) -> bool:
        return self.pixel_values is not None and self.image_embeds is None

    @staticmethod
    def finish_reason_for(status: RequestStatus) -> str | None:
        """OpenAI finish reason of a finished ``status``."""
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(status)

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's ``stop`` / ``length`` (``abort`` for cancelled requests), None while running."""
        return self.finish_reason_for(self.status)
