"""Measure our engine's forward-pass times at a few sizes, for the planner's fitted latency model.

Each point times one forward pass of :class:`ModelRunner` (prefill batch,
decode step, image encode) on random token ids, after a warm-up, taking the
median of ``repeats`` runs. The output rows match ``mm_serve.planner.profile_file``.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from mm_serve.cluster.host_memory import total_bytes
from mm_serve.colocated.llm_engine import LLMEngine
from mm_serve.planner.profile_file import DecodePoint, EncodePoint, PrefillPoint, points_to_json
from mm_serve.runtime.engine_config import EngineConfig
from mm_serve.runtime.request import Request
from mm_serve.runtime.warm_up import free_scratch, scratch_requests

UNKNOWN_MEMORY_BYTES = 16 * 2**30
"""A profile's ``memory_bytes`` where this machine's memory cannot be read (no ``/proc/meminfo``)."""


def _seconds(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    return statistics.median(_seconds(fn, repeats))


class EngineProfiler:
    """Times prefill, decode and encode passes of an :class:`LLMEngine`'s runner."""

    def __init__(self, engine: LLMEngine, repeats: int = 3, seed: int = 0) -> None:
        self.engine = engine
        self.repeats = repeats
        self.rng = random.Random(seed)
        self.vocab = engine.model_config.text.vocab_size

    def _requests(self, batch: int, tokens: int) -> list[Request]:
        engine = self.engine
        return scratch_requests(engine.kv_cache.pool, engine.config.page_size, self.vocab, batch, tokens, self.rng)

    def _free(self, requests: list[Request]) -> None:
        free_scratch(self.engine.kv_cache.pool, requests)

    @torch.inference_mode()
    def prefill(self, tokens: int, batch: int) -> float:
        """Seconds for one prefill pass of ``batch`` prompts of ``tokens`` tokens."""
        requests = self._requests(batch, tokens)
        try:
            return _median_seconds(lambda: self.engine.runner.prefill(requests), self.repeats)
        finally:
            self._free(requests)

    def decode(self, batch: int, context: int) -> float:
        """Seconds for one decode step of ``batch`` sequences with ``context`` tokens of KV each (the median
        of ``repeats``)."""
        return statistics.median(self.decode_steps(batch, context, self.repeats))

    @torch.inference_mode()
    def decode_steps(self, batch: int, context: int, steps: int) -> list[float]:
        """Seconds of each of ``steps`` decode steps of ``batch`` sequences with ``context`` tokens of KV
        each, after one untimed step (the same sequences every step)."""
        requests = self._requests(batch, context)
        try:
            self.engine.runner.prefill(requests)
            for request in requests:
                request.output_token_ids = [7]
            return _seconds(lambda: self.engine.runner.decode(requests), steps)
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


def _measure_points(prof: EngineProfiler, prefill_tokens: Sequence[int], decode_batches: Sequence[int],
                    decode_contexts: Sequence[int], log: Callable[[str], None]) -> dict[str, list[dict[str, float]]]:
    """Time every size on the current torch threads: the rows of a profile (or of a ``tensor_parallel`` entry)."""
    prefill: list[PrefillPoint] = []
    decode: list[DecodePoint] = []
    encode: list[EncodePoint] = []
    for tokens in prefill_tokens:
        prefill.append(PrefillPoint(tokens, 1, prof.prefill(tokens, 1)))
        log(f"prefill tokens={tokens:5d}              {prefill[-1].seconds * 1000:9.2f} ms")
    for batch in decode_batches:
        for context in decode_contexts:
            decode.append(DecodePoint(batch, context, prof.decode(batch, context)))
            log(f"decode  batch={batch:3d} context={context:5d} {decode[-1].seconds * 1000:9.2f} ms")
    for images in (1, 4):
        try:
            encoded = prof.encode(images)
        except ValueError as exc:  # e.g. Qwen2-VL's tower takes patches and grids, not square images
            log(f"encode  not timed: {exc}")
            break
        if encoded is not None:
            encode.append(EncodePoint(images, encoded))
            log(f"encode  images={images}                {encoded * 1000:9.2f} ms")
    return points_to_json(prefill, decode, encode)


def measure_profile(
    model_dir: str | Path, threads: int = 1, repeats: int = 3, prefill_tokens: Sequence[int] = (32, 128, 512, 1024),
    decode_batches: Sequence[int] = (1, 4, 16, 32), decode_contexts: Sequence[int] = (128, 512),
    log: Callable[[str], None] = print, dtype: str = "auto", parallel_threads: Sequence[int] = (),
) -> dict[str, Any]:
    """Time the engine of ``model_dir`` in ``dtype`` on ``threads`` torch threads and return a profile
    (the ``mm-serve-profile/1`` format of :mod:`mm_serve.planner.profile_file`); ``log`` gets one line
    per point. Sizes past the model's context are left out, and so are encode points of a tower that
    takes no square image batch (the dynamic-resolution families: the planner then prices encoding
    with the prefill coefficients). Each count in ``parallel_threads`` (above ``threads``) times the same
    sizes again on that many threads, as a ``tensor_parallel`` entry of that degree: on a CPU an
    instance of several cores is one worker on as many threads, and the planner prices it from these
    points instead of dividing one thread's times (threads share memory bandwidth and caches). The
    profile's ``memory_bytes`` is this machine's memory (``MemTotal``, bytes): a CPU instance keeps its
    weights and KV pages in it.

    Raises:
        ValueError: no prefill size or decode context fits the model's context, or ``parallel_threads``
            is given with ``threads`` other than 1 (a degree counts threads of one device's thread), or
            holds a count below 2.
    """
    if parallel_threads and (threads != 1 or min(parallel_threads) < 2):
        raise ValueError(f"parallel_threads {list(parallel_threads)} needs threads=1 (got {threads}) and counts above 1")
    torch.set_num_threads(threads)
    need = max(max(prefill_tokens), max(decode_batches) * (max(decode_contexts) + 16))
    engine = LLMEngine(model_dir, EngineConfig(num_pages=need // 16 + 64, dtype=dtype))  # type: ignore[arg-type]
    limit = engine.max_model_len - 1
    prefill_tokens = [t for t in prefill_tokens if t <= limit]
    decode_contexts = [c for c in decode_contexts if c <= limit]
    if not prefill_tokens or not decode_contexts:
        raise ValueError(f"no profile size fits the model's context ({engine.max_model_len} tokens)")
    prof = EngineProfiler(engine, repeats)
    rows = _measure_points(prof, prefill_tokens, decode_batches, decode_contexts, log)
    parallel = []
    try:
        for count in sorted(set(parallel_threads)):
            torch.set_num_threads(count)
            prefix = f"[{count} threads] "
            points = _measure_points(prof, prefill_tokens, decode_batches, decode_contexts,
                                     lambda line: log(prefix + line))  # noqa: B023 (called within this iteration)
            parallel.append({"degree": count, **points})
    finally:
        torch.set_num_threads(threads)
    profile: dict[str, Any] = {
        "format": "mm-serve-profile/1", "name": f"cpu-{threads}thread",
        "device": f"{os.cpu_count()} CPU cores, {threads} torch thread(s), torch {torch.__version__}",
        "memory_bytes": total_bytes() or UNKNOWN_MEMORY_BYTES, "model": str(Path(model_dir).resolve()),
        "dtype": engine.config.dtype, **rows,
    }
    if parallel:
        profile["tensor_parallel"] = parallel
    return profile
