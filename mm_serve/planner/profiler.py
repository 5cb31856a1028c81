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
from typing import Any, TypeVar

import torch

from mm_serve.cluster.host_memory import total_bytes
from mm_serve.colocated.llm_engine import LLMEngine
from mm_serve.planner.profile_file import DecodePoint, EncodePoint, PrefillPoint, points_to_json
from mm_serve.runtime.engine_config import EngineConfig
from mm_serve.runtime.request import Request
from mm_serve.runtime.warm_up import free_scratch, scratch_requests

UNKNOWN_MEMORY_BYTES = 16 * 2**30
"""A profile's ``memory_bytes`` where this machine's memory cannot be read (no ``/proc/meminfo``)."""

T = TypeVar("T")


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


def measure_points(prof: EngineProfiler, thread_counts: Sequence[int], prefill_tokens: Sequence[int],
                   decode_batches: Sequence[int], decode_contexts: Sequence[int],
                   log: Callable[[str], None]) -> list[dict[str, list[dict[str, float]]]]:
    """Time every size on each of ``thread_counts`` torch threads: one profile's rows per count, in that
    order (the first count's rows are the profile's own, the others its ``tensor_parallel`` entries).

    Each size is timed on every count before the next size, so a change in the machine's speed while
    profiling (a neighbour on a shared host) falls on the counts alike: the planner compares their
    times (one worker on two threads against two one-thread workers), and timing all of one count's
    sizes before the other's let a minute's slowdown decide that comparison. The torch threads are
    left at the first count.
    """
    counts = list(thread_counts)
    prefill: list[list[PrefillPoint]] = [[] for _ in counts]
    decode: list[list[DecodePoint]] = [[] for _ in counts]
    encode: list[list[EncodePoint]] = [[] for _ in counts]
    prefixes = [f"[{count} threads] " if i else "" for i, count in enumerate(counts)]

    def each_count(time_one: Callable[[], T]) -> list[T]:
        seconds = []
        for count in counts:
            torch.set_num_threads(count)
            seconds.append(time_one())
        return seconds

    try:
        for tokens in prefill_tokens:
            for i, t in enumerate(each_count(lambda: prof.prefill(tokens, 1))):  # noqa: B023 (called at once)
                prefill[i].append(PrefillPoint(tokens, 1, t))
                log(f"{prefixes[i]}prefill tokens={tokens:5d}              {t * 1000:9.2f} ms")
        for batch in decode_batches:
            for context in decode_contexts:
                for i, t in enumerate(each_count(lambda: prof.decode(batch, context))):  # noqa: B023
                    decode[i].append(DecodePoint(batch, context, t))
                    log(f"{prefixes[i]}decode  batch={batch:3d} context={context:5d} {t * 1000:9.2f} ms")
        for images in (1, 4):
            try:
                encoded = each_count(lambda: prof.encode(images))  # noqa: B023
            except ValueError as exc:  # e.g. Qwen2-VL's tower takes patches and grids, not square images
                log(f"encode  not timed: {exc}")
                break
            for i, seconds in enumerate(encoded):
                if seconds is not None:
                    encode[i].append(EncodePoint(images, seconds))
                    log(f"{prefixes[i]}encode  images={images}                {seconds * 1000:9.2f} ms")
    finally:
        torch.set_num_threads(counts[0])
    return [points_to_json(p, d, e) for p, d, e in zip(prefill, decode, encode, strict=True)]


def sized_profiler(model_dir: str | Path, repeats: int, prefill_tokens: Sequence[int], decode_batches: Sequence[int],
                   decode_contexts: Sequence[int], dtype: str = "auto") -> tuple[EngineProfiler, list[int], list[int]]:
    """A profiler of ``model_dir``'s engine in ``dtype`` with KV pages for the largest of these sizes, and the
    prefill lengths and decode contexts (tokens) that fit the model's context.

    Raises:
        ValueError: no prefill size or decode context fits the model's context.
    """
    need = max(max(prefill_tokens), max(decode_batches) * (max(decode_contexts) + 16))
    engine = LLMEngine(model_dir, EngineConfig(num_pages=need // 16 + 64, dtype=dtype))  # type: ignore[arg-type]
    limit = engine.max_model_len - 1
    fitting_prefill = [t for t in prefill_tokens if t <= limit]
    fitting_contexts = [c for c in decode_contexts if c <= limit]
    if not fitting_prefill or not fitting_contexts:
        raise ValueError(f"no profile size fits the model's context ({engine.max_model_len} tokens)")
    return EngineProfiler(engine, repeats), fitting_prefill, fitting_contexts


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
    prof, prefill_tokens, decode_contexts = sized_profiler(model_dir, repeats, prefill_tokens, decode_batches,
                                                           decode_contexts, dtype)
    degrees = sorted(set(parallel_threads))
    rows, *parallel_rows = measure_points(prof, [threads, *degrees], prefill_tokens, decode_batches,
                                          decode_contexts, log)
    parallel = [{"degree": count, **points} for count, points in zip(degrees, parallel_rows, strict=True)]
    profile: dict[str, Any] = {
        "format": "mm-serve-profile/1", "name": f"cpu-{threads}thread",
        "device": f"{os.cpu_count()} CPU cores, {threads} torch thread(s), torch {torch.__version__}",
        "memory_bytes": total_bytes() or UNKNOWN_MEMORY_BYTES, "model": str(Path(model_dir).resolve()),
        "dtype": prof.engine.config.dtype, **rows,
    }
    if parallel:
        profile["tensor_parallel"] = parallel
    return profile
