"""Scratch requests on a worker's own KV pages, and the warm-up pass a worker runs before it reports ready.

A fresh process pays for lazy initialisation on its first passes (oneDNN primitive and allocator
caches, the first call of each custom kernel, torch.compile'd attention, CUDA context and handles, a
vision tower's first batch). :func:`warm_up` runs one short prefill, one decode step and (for a worker
with a tower that takes square images) one image encode on throw-away inputs, so that the first user
request does not pay the worker's share of it. On a CPU that share is small: the first request of a
fresh bench-llava server stays ~20 ms slower than the next ones with or without the pass (the rest is
the API process's first paths; benchmarks/results/2026-12-05-decode-step-profile.md); on a GPU it has
not been measured. Once a worker has reported ready it also builds its structured-output compiler in
the background (:meth:`~mm_serve.runtime.worker_shell.WorkerShell.serve`). The planner's profiler
builds its timed requests with the same :func:`scratch_requests`.
"""

from __future__ import annotations

import random

import torch

from mm_serve.kernels.page_pool import PagePool
from mm_serve.runtime.kv_cache import pages_for
from mm_serve.runtime.model_runner import ModelRunner
from mm_serve.runtime.request import Request
from mm_serve.runtime.sampling_params import SamplingParams

WARM_UP_TOKENS = 32  # prompt tokens of the warm-up request (at most the context less two)


def scratch_requests(pool: PagePool, page_size: int, vocab_size: int, batch: int, tokens: int,
                     rng: random.Random) -> list[Request]:
    """``batch`` requests of ``tokens`` random prompt ids (from 5 up, past the usual special tokens),
    each with pages for ``tokens + 1`` tokens taken from ``pool``. Give the pages back with
    :func:`free_scratch`.

    Raises:
        PagePoolExhaustedError: ``pool`` has too few free pages.
    """
    out = []
    for i in range(batch):
        request = Request(f"scratch-{i}", [rng.randrange(5, vocab_size) for _ in range(tokens)],
                          SamplingParams(max_tokens=1))
        request.block_table = pool.allocate(pages_for(tokens + 1, page_size))
        out.append(request)
    return out


def free_scratch(pool: PagePool, requests: list[Request]) -> None:
    """Return the pages of :func:`scratch_requests`' requests to ``pool``."""
    for request in requests:
        pool.free(request.block_table)
        request.block_table = []


@torch.inference_mode()
def warm_up(runner: ModelRunner, context_len: int, decode: bool = True, encode: bool = True) -> bool:
    """One prefill of :data:`WARM_UP_TOKENS` random tokens, then (``decode``) one decode step, on
    pages borrowed from the runner's pool and given back, and (``encode``) one image through the
    vision tower when it takes a square image batch. Leaves no page used, nothing in a prefix or
    encoder cache, and ``num_encoded_images`` unchanged.

    Args:
        context_len: the model's context in tokens (the warm-up prompt is cut to fit).

    Returns:
        False when it was skipped: too few free pages or a context under three tokens.
    """
    pool, page_size = runner.kv_cache.pool, runner.page_size
    tokens = min(WARM_UP_TOKENS, context_len - 2)
    if tokens < 1 or pool.num_free < pages_for(tokens + 1, page_size):
        return False
    model = runner.model
    requests = scratch_requests(pool, page_size, model.config.text.vocab_size, 1, tokens, random.Random(0))
    try:
        runner.prefill(requests)
        if decode:  # the pages hold one more token: the decode step's
            requests[0].output_token_ids = [requests[0].prompt_token_ids[-1]]
            runner.decode(requests)
    finally:
        free_scratch(pool, requests)
    vision = model.config.vision
    if encode and model.vision is not None and vision is not None and not vision.dynamic_resolution:
        model.encode_images(torch.zeros(1, 3, vision.image_size, vision.image_size,
                                        dtype=runner.kv_cache.data.dtype, device=runner.device))
    return True
