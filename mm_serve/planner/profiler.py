"""Measure our engine's forward-pass times at a few sizes, for the planner's fitted latency model.

Each point times one forward pass of :class:`ModelRunner` (prefill batch,
decode step, image encode) on random token ids, after a warm-up, taking the
median of ``repeats`` runs. The output rows match ``mm_serve.planner.profile_file``.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import torch

from mm_serve.colocated.llm_engine import LLMEngine
from mm_serve.runtime.kv_cache import pages_for
from mm_serve.runtime.request import Request
from mm_serve.runtime.sampling_params import SamplingParams


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class EngineProfiler:
    """Times prefill, decode and encode passes of an :class:`LLMEngine`'s runner."""

    def __init__(self, engine: LLMEngine, repeats: int = 3, seed: int = 0) -> None:
        self.engine = engine
        self.repeats = repeats
        self.rng = random.Random(seed)
        self.vocab = engine.model_config.text.vocab_size

    def _requests(self, batch: int, tokens: int) -> list[Request]:
        pool = self.engine.kv_cache.pool
        out = []
        for i in range(batch):
            ids = [self.rng.randrange(5, self.vocab) for _ in range(tokens)]
            request = Request(f"profile-{i}", ids, SamplingParams(max_tokens=1))
            request.block_table = pool.allocate(pages_for(tokens + 1, self.engine.config.page_size))
            out.append(request)
        return out

    def _free(self, requests: list[Request]) -> None:
        for request in requests:
            self.engine.kv_cache.pool.free(request.block_table)

    @torch.inference_mode()
    def prefill(self, tokens: int, batch: int) -> float:
        """Seconds for one prefill pass of ``batch`` prompts of ``tokens`` tokens."""
        requests = self._requests(batch, tokens)
        try:
            return _median_seconds(lambda: self.engine.runner.prefill(requests), self.repeats)
        finally:
            self._free(requests)

    @torch.inference_mode()
    def decode(self, batch: int, context: int) -> float:
        """Seconds for one decode step of ``batch`` sequences with ``context`` tokens of KV each."""
        requests = self._requests(batch, context)
        try:
            self.engine.runner.prefill(requests)
            for request in requests:
                request.output_token_ids = [7]
            return _median_seconds(lambda: self.engine.runner.decode(requests), self.repeats)
        finally:
            self._free(requests)

    @torch.inference_mode()
    def encode(self, images: int) -> float | None:
        """Seconds to encode ``images`` square images of the tower's input size, one tower pass each
        (None for a text-only model)."""
        model = self.engine.model
        if model.vision is None:
            return None
        size = model.config.vision.image_size if model.config.vision else 224
        pixels = torch.randn(images, 3, size, size)
        return _median_seconds(lambda: model.encode_images(pixels), self.repeats)
