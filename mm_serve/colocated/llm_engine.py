"""The colocated engine: one process runs encode, prefill and decode with continuous batching.

Start-up reads as a story: load the model, size the KV cache, build the
scheduler, serve. :meth:`LLMEngine.step` runs one scheduler step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from mm_serve.inputs.input_processor import InputProcessor, InvalidRequestError, ProcessedInputs
from mm_serve.models.registry import load_model_config
from mm_serve.runtime.detokenizer import IncrementalDetokenizer
from mm_serve.runtime.engine_config import EngineConfig
from mm_serve.runtime.kv_cache import pages_for
from mm_serve.runtime.malloc_tuning import tune_malloc_for_inference
from mm_serve.runtime.model_runner import ModelRunner
from mm_serve.runtime.page_hashes import image_content_hashes, salted
from mm_serve.runtime.post_step import StopCriteria, process_step
from mm_serve.runtime.request import Request, RequestStatus
from mm_serve.runtime.sampler import Sampler, make_generator, sample_requests
from mm_serve.runtime.sampling_params import SamplingParams
from mm_serve.runtime.structured_output import GrammarBook
from mm_serve.runtime.worker_setup import load_model_for, make_caches, make_kv_cache
from mm_serve.text_decode.scheduler import ContinuousBatchingScheduler


@dataclass(frozen=True)
class StepWork:
    """What one :meth:`LLMEngine.step_all` computed, for a worker's step timing: its prefill part
    (requests, prompt tokens computed, the cached prefix not counted, and vision-tower passes: images,
    or tiles of a tiling family's images) and its decode part (requests, their context tokens)."""

    prefill_requests: int = 0
    prefill_tokens: int = 0
    images: int = 0
    decode_requests: int = 0
    decode_context: int = 0


class LLMEngine:
    """Adds requests, steps the scheduler, reports finished requests.

    Not thread-safe: one caller drives :meth:`step`.
    """

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        if self.config.device == "cpu":
            tune_malloc_for_inference()  # activations stay mapped between passes (malloc_tuning.py)
        self.model_config = load_model_config(self.model_dir)
        self.config = self.config.for_checkpoint(self.model_config.raw)  # dtype auto: the checkpoint's
        self.model = load_model_for(str(self.model_dir), self.config)
        self.inputs = InputProcessor(self.model_dir, self.model_config)
        self.tokenizer = self.inputs.tokenizer
        self.kv_cache = make_kv_cache(self.model_config, self.config)
        self.prefix, self.encoder_cache = make_caches(str(self.model_dir), self.model_config, self.config, self.kv_cache)
        self.runner = ModelRunner(
            self.model, self.kv_cache, cuda_graphs=self.config.use_cuda_graphs, max_running=self.config.max_running,
            encoder_cache=self.encoder_cache,
        )
        self.scheduler = ContinuousBatchingScheduler.from_config(self.kv_cache.pool, self.config, self.prefix, mixed=True)
        self.sampler = Sampler()
        self.max_model_len = self.config.context_limit(self.model_config.text)
        self.eos_token_ids = self.inputs.eos_token_ids
        self.stops = StopCriteria(self.eos_token_ids, self.max_model_len)
        self.grammars = GrammarBook(self.model_dir, self.eos_token_ids, self.tokenizer)
        self.requests: dict[str, Request] = {}
        self._seed_rng = random.Random(self.config.seed)
        self.last_step = StepWork()  # what the last step_all computed (nothing before the first)

    def add_request(
        self, request_id: str, inputs: ProcessedInputs, params: SamplingParams, generator_seed: int | None = None,
        output_offset: int = 0, priority: int = 1,
    ) -> Request:
        """Queue a processed request (``output_offset``: outputs it had before a migration; its
        random stream continues at that position; ``priority``: its SLO tier rank, 0 interactive,
        1 standard, 2 batch).

        Raises:
            InvalidRequestError: duplicate id, or prompt + ``max_tokens`` exceeds the
                context length or the whole KV cache (both numbers in the message).
        """
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        self.inputs.check_context(len(inputs.prompt_token_ids), params.max_tokens, self.max_model_len)
        seed = generator_seed if generator_seed is not None else (
            params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        )
        request = Request(
            request_id=request_id, prompt_token_ids=inputs.prompt_token_ids, sampling_params=params,
            num_images=inputs.num_images, pixel_values=inputs.pixel_values, image_token_counts=list(inputs.image_token_counts),
            image_tiles=list(inputs.image_tiles), image_sizes=list(inputs.image_sizes),
            image_second_per_grid=list(inputs.image_second_per_grid),
            generator=None if params.greedy else make_generator(seed), seed=None if params.greedy else seed,
            output_offset=output_offset,
            stop_matcher=IncrementalDetokenizer(self.tokenizer, params.stop, min_tokens=params.min_tokens)
            if params.stop else None,
            priority=priority, cache_salt=inputs.cache_salt,
            image_hashes=list(inputs.image_hashes) or [salted(h, inputs.cache_salt) for h in image_content_hashes(
                inputs.pixel_values, inputs.image_tiles, inputs.image_sizes, inputs.image_second_per_grid)],
        )
        self.requests[request_id] = request
        self.grammars.prefetch(request, self.model_config.text.vocab_size)  # compiled while it queues and prefills
        self.scheduler.add(request)
        return request

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[Request]:
        """Run one scheduler step; returns the requests that finished in it."""
        return self.step_all()[1]

    def step_all(self) -> tuple[list[Request], list[Request]]:
        """Run one scheduler step; returns (requests that got a token, requests that finished).

        With mixed steps a request whose pass was a chunk short of its last token gets no token
        (its KV so far is committed to the prefix cache, and its next chunk runs next step).
        """
        plan = self.scheduler.schedule()
        vision = self.model.vision
        encoded_before = 0 if vision is None else vision.num_encoded_tiles
        self.last_step = StepWork()
        if plan.empty:
            return [], []
        if plan.prefill:
            self.runner.encode_images(plan.prefill)
        self.last_step = StepWork(
            len(plan.prefill), sum((r.prefill_end or r.num_tokens) - r.num_cached_tokens for r in plan.prefill),
            0 if vision is None else vision.num_encoded_tiles - encoded_before,
            len(plan.decode), sum(r.num_tokens for r in plan.decode))
        logits = self.runner.mixed(plan.prefill, plan.decode)
        for request in plan.prefill:  # KV in place: shareable from now on
            self.prefix.commit(request, request.prefill_end or request.num_tokens)
        rows = [i for i, r in enumerate(plan.prefill) if r.prefill_done]
        batch = [plan.prefill[i] for i in rows] + plan.decode
        rows += range(len(plan.prefill), len(plan.prefill) + len(plan.decode))
        self.scheduler.chunk_done(plan.prefill)  # a chunk's request: its KV ends at its prefill_end now
        if not batch:
            return [], []
        tokens, logprobs = sample_requests(self.sampler, logits[rows], batch, self.eos_token_ids, self.grammars)
        return batch, process_step(batch, tokens, logprobs, self.stops, self.scheduler.finish)

    def output_text(self, request: Request) -> str:
        """Final text of a finished request (special tokens skipped, stop string cut)."""
        matcher = request.stop_matcher
        if isinstance(matcher, IncrementalDetokenizer) and matcher.stopped:
            return matcher.text
        return str(self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True))

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        self.requests.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Cancel a request in any stage; its pages return to the pool."""
        request = self.requests.get(request_id)
        if request is not None and not request.status.finished:
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)

    def num_free_pages(self) -> int:
        return self.kv_cache.pool.num_free

    def pages_needed(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.config.page_size)
