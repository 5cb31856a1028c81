"""Small factories for the policy tests: requests, schedulers, router, tiny KV caches and rings.

Everything here holds integers or tiny real tensors; nothing loads model weights.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from mm_serve.engine.load_ledger import LoadLedger
from mm_serve.engine.load_view import LoadView
from mm_serve.engine.router import Router
from mm_serve.ground.tiers import Tier
from mm_serve.kernels.page_pool import PagePool
from mm_serve.runtime.kv_cache import PagedKVCache, pages_for
from mm_serve.runtime.page_hashes import cache_salt
from mm_serve.runtime.prefix_cache import PrefixCache, PrefixKey
from mm_serve.runtime.request import Request
from mm_serve.runtime.sampling_params import SamplingParams
from mm_serve.text_decode.scheduler import ContinuousBatchingScheduler
from mm_serve.transport.ring_spec import RingSpec, unique_ring_name
from mm_serve.transport.shm_ring import ShmRing
from mm_serve.vision_prefill.prefill_scheduler import PrefillScheduler

PAGE_SIZE = 4
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 4
FEATURE_DIM = 8
RING_PREFIX = "mmsrv-"  # every unique_ring_name starts with it
RING_TAG = "-policy-"  # ... and the rings made here have this in their segment names


def make_request(
    request_id: str, num_prompt_tokens: int, max_tokens: int = 16, *, temperature: float = 0.0,
    stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, logprobs: int | None = None,
    seed: int | None = None, first_id: int = 10, outputs: Sequence[int] = (), decode_index: int = 0,
    priority: int = 1, max_wait_s: float = 0.0,
) -> Request:
    """A request with prompt ids ``first_id, first_id + 1, ...`` and ``outputs`` already generated."""
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, stop_token_ids=tuple(stop_token_ids),
        ignore_eos=ignore_eos, logprobs=logprobs, seed=seed,
    )
    request = Request(
        request_id, list(range(first_id, first_id + num_prompt_tokens)), params, decode_index=decode_index,
        priority=priority, max_wait_s=max_wait_s,
    )
    for token in outputs:
        request.append_output(token, None)
    return request


def create_requests(num_requests: int, num_tokens: int, max_tokens: int = 16) -> list[Request]:
    """``num_requests`` requests ``r0, r1, ...`` of ``num_tokens`` prompt tokens each."""
    return [make_request(f"r{i}", num_tokens, max_tokens) for i in range(num_requests)]


def make_scheduler(
    num_pages: int = 16, page_size: int = PAGE_SIZE, max_running: int = 8, prefill_token_budget: int = 64,
    prefill_batch_size: int = 8, prefix_caching: bool = False, mixed_step_tokens: int = 0,
) -> ContinuousBatchingScheduler:
    """A continuous-batching scheduler over a fresh ``PagePool(num_pages)`` (with a prefix cache
    over it when ``prefix_caching``; mixed steps of ``mixed_step_tokens`` when not 0)."""
    pool = PagePool(num_pages)
    prefix = None
    if prefix_caching:
        prefix = make_prefix_cache(page_size=page_size)
        prefix.pool = pool
    return ContinuousBatchingScheduler(pool, page_size, max_running, prefill_token_budget, prefill_batch_size, prefix,
                                       mixed_step_tokens)


IMAGE_TOKEN = 99  # the image placeholder id of the prefix-cache factories' requests


def make_prefix_cache(num_pages: int = 16, page_size: int = PAGE_SIZE, enabled: bool = True) -> PrefixCache:
    """A prefix cache over a fresh ``PagePool(num_pages)``; images are placeholders of id
    :data:`IMAGE_TOKEN`."""
    key = PrefixKey(cache_salt("policy-model", "float32"), IMAGE_TOKEN)
    return PrefixCache(PagePool(num_pages), page_size, key, enabled=enabled)


IMAGE_TOKENS = 3  # the image tokens each image of make_prompt_request takes, unless it says otherwise


def make_prompt_request(request_id: str, prompt: Sequence[int], image_hashes: Sequence[bytes] = (),
                        outputs: Sequence[int] = (), image_token_counts: Sequence[int] | None = None) -> Request:
    """A greedy request with exactly ``prompt`` (placeholders :data:`IMAGE_TOKEN` for its images, each
    :data:`IMAGE_TOKENS` of them unless ``image_token_counts`` says)."""
    counts = [IMAGE_TOKENS] * len(image_hashes) if image_token_counts is None else list(image_token_counts)
    request = Request(request_id, list(prompt), SamplingParams(max_tokens=16, temperature=0.0),
                      num_images=len(image_hashes), image_hashes=list(image_hashes), image_token_counts=counts)
    for token in outputs:
        request.append_output(token, None)
    return request


def make_prefill_scheduler(token_budget: int = 512, batch_size: int = 8, lookahead: int = 32) -> PrefillScheduler:
    """A prefill scheduler with an empty queue."""
    return PrefillScheduler(token_budget, batch_size, lookahead)


class Books:
    """A router and the load ledger it reads, kept as the engine client's flight table keeps them:
    a dispatch asks the router what is left to compute (its cache beliefs) and counts that in the
    ledger; a view is the ledger's view of the router's route. Other attributes are the ledger's,
    else the router's."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.ledger = router.ledger

    def dispatched(self, request_id: str, prefill: int, decode: int, tokens: int, pages: int, rank: int = 1,
                   images: int = 0, page_hashes: Sequence[bytes] = (), max_wait_s: float = 0.0,
                   now: float | None = None, arrived_at: float | None = None,
                   image_hashes: Sequence[bytes] = (), tiles: Sequence[int] = ()) -> None:
        tokens, images = self.router.work_left(prefill, tokens, images, page_hashes, image_hashes, tiles)
        self.ledger.dispatched(request_id, prefill, decode, tokens, pages, Tier(rank), images, max_wait_s, now,
                               arrived_at)

    def view(self, rank: int, pages_needed: int, prefills: Sequence[int], decodes: Sequence[int],
             page_hashes: Sequence[bytes] = (), now: float | None = None, tokens: int = 0) -> LoadView:
        route = self.router.route(pages_needed, prefills, decodes, page_hashes, tokens)
        return self.ledger.view(Tier(rank), route, now)

    def reset_prefill(self, index: int) -> None:
        self.ledger.reset_prefill(index)
        self.router.forget_prefill(index)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ledger, name) if hasattr(self.ledger, name) else getattr(self.router, name)


def make_router(
    num_prefill: int = 2, num_decode: int = 2, decode_pages_total: int = 100, max_running: int = 4,
    cache_aware: bool = False, balance_tokens: int = 2048, prefill_pages: int = 64, encoder_images: int = 0,
) -> Books:
    """A router over a ledger with fresh load counters."""
    ledger = LoadLedger(num_prefill, num_decode, decode_pages_total)
    return Books(Router(ledger, max_running, cache_aware=cache_aware, balance_tokens=balance_tokens,
                        prefill_pages=prefill_pages, page_size=PAGE_SIZE, encoder_images=encoder_images))


def make_kv_cache(num_pages: int = 8) -> PagedKVCache:
    """A float32 CPU paged KV cache with the ring page shape of :func:`make_ring_spec`."""
    return PagedKVCache(NUM_LAYERS, num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)


def make_ring_spec(**overrides: object) -> RingSpec:
    """A small ring spec with a unique name (pages match :func:`make_kv_cache`)."""
    spec = RingSpec(
        name=unique_ring_name(RING_TAG.strip("-")), num_pages=8, page_shape=(NUM_LAYERS, 2, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM),
        dtype="float32", feature_rows=32, feature_dim=FEATURE_DIM, capacity=4, max_pages_per_handoff=4,
        meta_bytes=8192,
    )
    return msgspec.structs.replace(spec, **overrides) if overrides else spec


class RingFactory:
    """Creates (producer, consumer) ring pairs in this process; :meth:`close_all` removes them."""

    def __init__(self) -> None:
        self.pairs: list[tuple[ShmRing, ShmRing]] = []

    def create(self, **overrides: object) -> tuple[ShmRing, ShmRing]:
        """A fresh ring: the creating (producer) side and an attached (consumer) side."""
        spec = make_ring_spec(**overrides)
        producer = ShmRing.create(spec)
        consumer = ShmRing.attach(spec)
        self.pairs.append((producer, consumer))
        return producer, consumer

    def names(self) -> list[str]:
        return [producer.spec.name for producer, _ in self.pairs]

    def close_all(self) -> None:
        """Close both sides of every ring and unlink its segments."""
        for producer, consumer in self.pairs:
            consumer.close()
            producer.close()
            producer.unlink()


def shm_entries(prefixes: Sequence[str]) -> list[str]:
    """Names in /dev/shm that start with one of ``prefixes``."""
    return sorted(n for n in os.listdir("/dev/shm") if any(n.startswith(p) for p in prefixes))


def prefilled_request(
    cache: PagedKVCache, request_id: str, num_prompt_tokens: int, first_token: int, *, fill: float = 0.0,
    **kwargs: object,
) -> Request:
    """A request as the prefill worker leaves it: KV pages allocated and filled, first token sampled.

    Page ``j`` of the request holds ``fill + j * 1000 + arange`` (distinct values everywhere).
    """
    request = make_request(request_id, num_prompt_tokens, **kwargs)  # type: ignore[arg-type]
    request.block_table = cache.pool.allocate(pages_for(num_prompt_tokens, cache.page_size))
    page_elems = cache.data[0].numel()
    for j, page in enumerate(request.block_table):
        values = fill + j * 1000.0 + torch.arange(page_elems, dtype=torch.float32)
        cache.data[page].copy_(values.view(cache.data.shape[1:]))
    request.append_output(first_token, None)
    return request
