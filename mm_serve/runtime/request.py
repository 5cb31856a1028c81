"""The request object that moves through the schedulers: it owns its state.

Token ids, outputs, its block table, its sampling generator, its lifetime events and
how many of its outputs the front end has been sent all live here, so a worker keeps
one ``dict[str, Request]`` and never parallel dicts. No tensors inside, except the
image inputs a request carries until (``pixel_values``) and after (``image_embeds``)
the vision tower runs.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from mm_serve.runtime.lifetime import LifetimeEvent
from mm_serve.runtime.sampling_params import SamplingParams

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


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class StopStringMatcher(Protocol):
    """Watches a request's text for stop strings (the front end's incremental detokenizer).

    Only engines that hold a tokenizer set one (the in-process colocated engine); workers
    have none, and the front end cuts stop strings from their streams.
    """

    @property
    def stopped(self) -> bool: ...

    @property
    def stop_string(self) -> str | None: ...

    def add(self, token_ids: list[int]) -> str: ...


@dataclass(eq=False)
class Request:
    """One generation: prompt ids (image placeholders already expanded), outputs and KV pages.

    Compared by identity (``in`` and ``remove`` on the schedulers' queues never look inside).

    ``image_embeds`` (projected patch embeddings ``[num_image_tokens_total, hidden]``)
    is kept for the whole life of the request so a preempted request is
    recomputed from token ids plus embeddings, without re-running the vision encoder.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    num_images: int = 0
    pixel_values: torch.Tensor | None = None  # [num_images, 3, H, W] (or [sum(image_tiles), 3, H, W]) until encoded
    image_embeds: torch.Tensor | None = None  # [num_image_tokens_total, hidden] once encoded
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    stop_reason: int | str | None = None  # the stop token id, or the stop string, that finished it
    generator: torch.Generator | None = None  # CPU generator of a sampled request; None when greedy
    seed: int | None = None  # the generator's seed: each draw re-seeds it (sampler.position_seed)
    output_offset: int = 0  # outputs produced before this request was (re)submitted (a migration)
    events: dict[LifetimeEvent, float] = field(default_factory=dict)  # time.time() seconds
    num_sent_tokens: int = 0  # outputs already reported to the front end (see post_step.token_update)
    decode_index: int = 0  # prefill worker only: the decode worker its KV is handed to
    stop_matcher: StopStringMatcher | None = None
    cache_salt: bytes = b""  # page_hashes.request_salt of its cache_salt: the root of its page hashes is salted
    grammar_matcher: object | None = None  # xgrammar's matcher of a structured request (runtime.structured_output)
    json_closing: object | None = None  # a json_object request's json_closing.JsonClosing (built with its matcher)
    json_closed_by_budget: bool = False  # max_tokens made the sampler write its JSON's closing (it ends as length)
    grammar_failure: str | None = None  # why its grammar cannot go on (no token allowed next): it ends with this error
    grammar_complete: bool = False  # its grammar was complete before its next token (nothing may follow): it ends, no token
    logit_state: object | None = None  # logit_controls.TokenCounts, built when a penalty first needs it
    priority: int = 1  # SLO tier rank: 0 interactive, 1 standard, 2 batch; lower is served first, preempted last
    max_wait_s: float = 0.0  # prefill ageing: waiting longer than this (seconds) it counts as rank 0; 0 = never
    image_hashes: list[bytes] = field(default_factory=list)  # content hash per image (runtime.page_hashes)
    image_token_counts: list[int] = field(default_factory=list)  # image tokens of each image, in order
    image_tiles: list[int] = field(default_factory=list)  # rows of pixel_values per image ([]: one each)
    # per image, what its features need: LLaVA-NeXT its original (height, width), Qwen2-VL its patch grid
    # (h, w), a video's (t, h, w)
    image_sizes: list[tuple[int, ...]] = field(default_factory=list)
    # per image, seconds of video a temporal patch spans (0: a still; []: no video): Qwen2.5-VL's M-RoPE
    image_second_per_grid: list[float] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full pages so far (prefix cache)
    num_cached_tokens: int = 0  # tokens at the head of block_table whose KV is in place before this prefill pass
    #   (a prefix-cache hit, then the chunks already prefilled)
    prefill_end: int = 0  # a chunked prefill pass computes tokens [num_cached_tokens, prefill_end); 0 = to the end
    num_prompt_cached_tokens: int = 0  # of its prompt, tokens whose KV was reused at its first prefill (usage)
    # M-RoPE (Qwen2-VL): the prompt's position ids [3, num_prompt_tokens] and the offset of the tokens after it,
    # derived from the prompt and its images' grids by the model runner where first needed (never sent)
    mrope_positions: torch.Tensor | None = None
    rope_delta: int = 0
    # SamplingParams.prompt_logprobs: per prompt token (None for the first), filled by the prefill passes
    prompt_logprobs: list[dict[int, float] | None] | None = None

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
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's log-probabilities are asked for and not yet sent: a first prefill (no output yet,
        not a migration's), which computes every prompt position (no prefix-cache hit)."""
        return (self.sampling_params.prompt_logprobs is not None and self.output_offset == 0
                and not self.output_token_ids)

    @property
    def prefill_done(self) -> bool:
        """This prefill pass reaches the last token (no chunk of the prompt is left after it)."""
        return self.prefill_end == 0 or self.prefill_end >= self.num_tokens

    def set_prefill_chunk(self, limit: int) -> int:
        """Set ``prefill_end`` for the next prefill pass: at most ``limit`` tokens (0: no limit) from
        where the KV ends (``num_cached_tokens``), ``prefill_end`` 0 when the pass reaches the last
        token (chunked prefill, Sarathi-Serve). Returns the pass's tokens."""
        left = self.num_tokens - self.num_cached_tokens
        chunked = 0 < limit < left
        self.prefill_end = self.num_cached_tokens + limit if chunked else 0
        return limit if chunked else left

    def end_chunk(self) -> None:
        """After a pass that was a chunk: the KV now ends at its ``prefill_end``, and no pass is set."""
        self.num_cached_tokens, self.prefill_end = self.prefill_end, 0

    @property
    def needs_encoding(self) -> bool:
        return self.pixel_values is not None and self.image_embeds is None

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's ``stop`` / ``length`` (``abort`` for cancelled requests), None while running."""
        return _FINISH_REASONS.get(self.status)

    def stamp(self, event: LifetimeEvent, seconds: float | None = None) -> None:
        """Record ``event`` at ``seconds`` (default now, ``time.time()``) unless already recorded."""
        self.events.setdefault(event, time.time() if seconds is None else seconds)

    def append_output(self, token: int, logprobs: dict[int, float] | None) -> None:
        """Add one sampled token (and its log-probabilities when the request asked for them)."""
        self.output_token_ids.append(token)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
