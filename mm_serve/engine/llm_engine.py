"""The colocated engine: one process runs encode, prefill and decode with continuous batching.

Start-up reads as a story: load the model, size the KV cache, build the
scheduler, serve. :meth:`LLMEngine.step` runs one scheduler step.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from mm_serve.engine.engine_config import EngineConfig
from mm_serve.engine.input_processor import InputProcessor, InvalidRequestError, ProcessedInputs
from mm_serve.engine.malloc_tuning import tune_malloc_for_inference
from mm_serve.engine.model_runner import ModelRunner
from mm_serve.engine.request import Request, RequestStatus
from mm_serve.models.loader import load_model
from mm_serve.models.model_config import load_model_config
from mm_serve.sampling_params import SamplingParams
from text_decode.detokenizer import IncrementalDetokenizer
from text_decode.kv_cache import PagedKVCache, pages_for
from text_decode.sampler import Sampler, make_generator, sample_requests
from text_decode.scheduler import ContinuousBatchingScheduler
from text_decode.stop_checker import check_stop_token


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
        self.model = load_model(
            self.model_dir, self.config.torch_dtype, self.config.device, pack_cpu_linears=self.config.pack_cpu_linears,
            compiled_cpu_kernels=self.config.compiled_cpu_kernels,
        )
        self.inputs = InputProcessor(self.model_dir, self.model_config)
        self.tokenizer = self.inputs.tokenizer
        self.kv_cache = self._make_kv_cache()
        self.runner = ModelRunner(
            self.model, self.kv_cache, cuda_graphs=self.config.use_cuda_graphs, max_batch=self.config.max_running,
        )
        self.scheduler = ContinuousBatchingScheduler(
            self.kv_cache.pool, self.config.page_size, self.config.max_running,
            self.config.prefill_token_budget, self.config.prefill_batch_size,
        )
        self.sampler = Sampler()
        self.max_model_len = self.config.resolved_max_model_len(self.model_config.text)
        eos = set(self.model_config.text.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self.requests: dict[str, Request] = {}
        self._generators: dict[str, torch.Generator | None] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}  # requests with stop strings
        self._seed_rng = random.Random(self.config.seed)

    def _make_kv_cache(self) -> PagedKVCache:
        text = self.model_config.text
        return PagedKVCache(
            text.num_layers, self.config.num_pages, self.config.page_size, text.num_kv_heads,
            text.head_dim, self.config.torch_dtype, self.config.device,
        )

    def add_request(
        self, request_id: str, inputs: ProcessedInputs, params: SamplingParams, generator_seed: int | None = None
    ) -> Request:
        """Queue a processed request.

        Raises:
            InvalidRequestError: duplicate id, or prompt + ``max_tokens`` exceeds the
                context length or the whole KV cache (both numbers in the message).
        """
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        total = len(inputs.prompt_token_ids) + params.max_tokens
        capacity = min(self.max_model_len, self.config.num_pages * self.config.page_size)
        if total > capacity:
            raise InvalidRequestError(
                f"prompt ({len(inputs.prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                f"is {total} tokens, over this model's context length of {capacity} tokens"
            )
        request = Request(
            request_id=request_id, prompt_token_ids=inputs.prompt_token_ids, sampling_params=params,
            num_images=inputs.num_images, pixel_values=inputs.pixel_values,
        )
        seed = generator_seed if generator_seed is not None else (
            params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        )
        self._generators[request_id] = None if params.greedy else make_generator(seed)
        self.requests[request_id] = request
        if params.stop:
            self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop)
        self.scheduler.add(request)
        return request

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[Request]:
        """Run one scheduler step; returns the requests that finished in it."""
        return self.step_all()[1]

    def step_all(self) -> tuple[list[Request], list[Request]]:
        """Run one scheduler step; returns (requests that got a token, requests that finished)."""
        plan = self.scheduler.schedule()
        if plan.empty:
            return [], []
        if plan.prefill:
            self.runner.encode_images(plan.prefill)
            batch, logits = plan.prefill, self.runner.prefill(plan.prefill)
        else:
            batch, logits = plan.decode, self.runner.decode(plan.decode)
        tokens, logprobs = sample_requests(self.sampler, logits, batch, self._generators)
        return batch, self._append_tokens(batch, tokens, logprobs)

    def _append_tokens(self, batch: list[Request], tokens: list[int], logprobs: list) -> list[Request]:
        finished = []
        for request, token, lp in zip(batch, tokens, logprobs, strict=True):
            request.output_token_ids.append(token)
            if lp is not None:
                request.output_logprobs.append(lp)
            status = check_stop_token(request, token, self.eos_token_ids, self.max_model_len)
            detok = self._detokenizers.get(request.request_id)
            if status is None and detok is not None:
                detok.add([token])
                if detok.stopped:
                    request.stop_reason = detok.stop_string
                    status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                self.scheduler.finish(request, status)
                finished.append(request)
        return finished

    def output_text(self, request: Request) -> str:
        """Final text of a finished request (special tokens skipped, stop string cut)."""
        detok = self._detokenizers.get(request.request_id)
        if detok is not None and detok.stopped:
            return detok.text
        return str(self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True))

    def release(self, request_id: str) -> None:
        """Forget a finished request's bookkeeping."""
        self.requests.pop(request_id, None)
        self._generators.pop(request_id, None)
        self._detokenizers.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Cancel a request in any stage; its pages return to the pool."""
        request = self.requests.get(request_id)
        if request is not None and not request.status.finished:
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)

    def num_free_pages(self) -> int:
        return self.kv_cache.pool.num_free

    def pages_needed(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.config.page_size)
