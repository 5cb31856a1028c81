"""Worker start-up steps shared by every role: pin cores, set threads, load the model, size the KV cache."""

from __future__ import annotations

import os

import torch

from mm_serve.models.llava import MultimodalLM
from mm_serve.models.loader import load_model
from mm_serve.models.model_config import ModelConfig
from mm_serve.models.registry import load_model_config
from mm_serve.runtime.encoder_cache import EncoderCache
from mm_serve.runtime.engine_config import EngineConfig
from mm_serve.runtime.kv_cache import PagedKVCache
from mm_serve.runtime.page_hashes import cache_salt
from mm_serve.runtime.prefix_cache import PrefixCache, PrefixKey
from mm_serve.runtime.thread_affinity import pin_threads
from mm_serve.runtime.worker_spec import WorkerSpec


def pin_and_set_threads(spec: WorkerSpec) -> None:
    """Pin this process to ``spec.cpus`` (if any), lower its priority by ``spec.nice`` and set
    torch's intra-op thread count."""
    if spec.nice > 0 and hasattr(os, "nice"):
        os.nice(spec.nice)
    if spec.cpus and hasattr(os, "sched_setaffinity"):
        # every thread started so far (a worker restarted from a front end kept off some cores starts with
        # that front end's cores), then those started later inherit it; without /proc, this thread
        if pin_threads(os.getpid(), set(spec.cpus)) is None:
            os.sched_setaffinity(0, set(spec.cpus))
    threads = spec.threads or len(spec.cpus)
    if threads:
        torch.set_num_threads(threads)


def load_model_for(model_dir: str, cfg: EngineConfig, vision: bool = True) -> MultimodalLM:
    """The checkpoint at ``model_dir`` in ``cfg``'s dtype, device and CPU kernel choices
    (``vision`` False: without a llava checkpoint's tower and projector).

    Raises:
        CheckpointError: the checkpoint is missing or unreadable.
    """
    return load_model(
        model_dir, cfg.torch_dtype, cfg.device, pack_cpu_linears=cfg.pack_cpu_linears,
        compiled_cpu_kernels=cfg.compiled_cpu_kernels, attention_backend=cfg.attention_backend, vision=vision,
    )


def make_kv_cache(model_config: ModelConfig, cfg: EngineConfig) -> PagedKVCache:
    """``cfg.num_pages`` KV pages shaped for ``model_config``'s decoder."""
    text = model_config.text
    return PagedKVCache(
        text.num_layers, cfg.num_pages, cfg.page_size, text.num_kv_heads, text.head_dim,
        cfg.torch_dtype, cfg.device,
    )


def load_for_worker(spec: WorkerSpec) -> tuple[ModelConfig, EngineConfig, MultimodalLM, PagedKVCache]:
    """Load the checkpoint (a decode worker's without the vision tower and projector: it receives
    image embeddings, never pixels) and allocate this worker's paged KV cache. Returns the
    checkpoint's config, the sizing the worker runs with (``dtype: auto`` settled against the
    checkpoint, as the front end settles it), the model and the cache."""
    model_config = load_model_config(spec.model_dir)
    sizing = spec.sizing.for_checkpoint(model_config.raw)
    model = load_model_for(spec.model_dir, sizing, vision=spec.role.prefills)
    return model_config, sizing, model, make_kv_cache(model_config, sizing)


def prefix_key(model_dir: str, model_config: ModelConfig, cfg: EngineConfig) -> PrefixKey:
    """How pages of this checkpoint are hashed: salted with the model directory and the dtype
    (KV computed in another dtype or by another model never matches); image spans from the
    checkpoint's image token and each request's image token counts."""
    vision = model_config.vision
    return PrefixKey(cache_salt(os.path.realpath(model_dir), cfg.dtype),
                     None if vision is None else vision.placeholder_ids)


def make_caches(
    model_dir: str, model_config: ModelConfig, cfg: EngineConfig, kv_cache: PagedKVCache,
) -> tuple[PrefixCache, EncoderCache | None]:
    """The prefix cache over ``kv_cache``'s pool (inactive when ``cfg.enable_prefix_caching`` is
    off) and the encoder cache (None for a text-only model or ``encoder_cache_bytes`` 0)."""
    prefix = PrefixCache(kv_cache.pool, cfg.page_size, prefix_key(model_dir, model_config, cfg),
                         enabled=cfg.enable_prefix_caching)
    encoder = None if model_config.vision is None or not cfg.encoder_cache_bytes else EncoderCache(cfg.encoder_cache_bytes)
    return prefix, encoder


def cache_report(prefix: PrefixCache, encoder: EncoderCache | None) -> dict[str, int]:
    """The prefix- and encoder-cache fields of :class:`~mm_serve.runtime.messages.WorkerStats`."""
    return {
        "prefix_queried_tokens": prefix.queried_tokens, "prefix_hit_tokens": prefix.hit_tokens,
        "kv_cached_pages": prefix.pool.num_cached, "kv_evictions": prefix.pool.num_evictions,
        "encoder_cache_hits": 0 if encoder is None else encoder.hits,
        "encoder_cache_misses": 0 if encoder is None else encoder.misses,
        "encoder_cache_bytes": 0 if encoder is None else encoder.bytes_used,
        "encoder_cache_evictions": 0 if encoder is None else encoder.evictions,
    }
