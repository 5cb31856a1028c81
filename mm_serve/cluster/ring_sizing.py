"""Size the cross-modal rings of a service from its config and model."""

from __future__ import annotations

from mm_serve.cluster.worker_specs import engine_sizing
from mm_serve.config import ServiceConfig
from mm_serve.models.model_config import ModelConfig
from mm_serve.runtime.kv_cache import pages_for
from mm_serve.transport.ring_spec import RingSpec


def kv_page_shape(model: ModelConfig, page_size: int) -> tuple[int, int, int, int, int]:
    """One KV page's shape, as the workers' caches and the rings hold it: ``[layers, 2 (K, V), page_size,
    kv_heads, head_dim]``."""
    text = model.text
    return (text.num_layers, 2, page_size, text.num_kv_heads, text.head_dim)


def ring_specs(instance: str, cfg: ServiceConfig, model: ModelConfig) -> list[RingSpec]:
    """One :class:`RingSpec` per (prefill, decode) pair, ordered prefill-major (p0d0, p0d1, ...).

    Pages: ``kv_cache.ring_pages`` (0 = a quarter of a worker's pages), never fewer
    than one maximal request needs. Feature arena: room for every slot to carry
    ``api.max_images_per_request`` images at once (at most a context's worth of rows), capped at 4
    slots' worth when large.
    """
    text = model.text
    page_size = cfg.kv_cache.page_size
    max_len = engine_sizing(cfg).context_limit(text)
    max_pages = pages_for(max_len, page_size)
    num_pages = max(cfg.kv_cache.ring_pages or cfg.kv_cache.max_pages_per_gpu // 4, max_pages)
    per_request_rows = 1
    if model.vision is not None:
        # image tokens are prompt tokens: never more than the context holds (Qwen2-VL's bounds allow
        # 16,384 tokens an image in released checkpoints)
        per_request_rows = min(max(1, cfg.api.max_images_per_request) * model.vision.max_image_tokens, max_len)
        if model.vision.video_token_index is not None:  # a video's tokens grow with its frames: up to the context
            per_request_rows = max_len
    capacity = cfg.scheduler.ring_buffer_size
    feature_rows = per_request_rows * min(capacity, 4)
    api = cfg.api  # msgpack ints <= 5 bytes; a (token, bias) pair <= 15; a grammar's characters <= 4 bytes each
    meta_bytes = (max_len * 5 + 16384 + api.max_stop_token_ids * 5 + api.max_logit_bias * 15
                  + api.max_grammar_chars * 4)
    specs = []
    for p in range(cfg.compute.prefill_workers):
        for d in range(cfg.compute.decode_workers):
            specs.append(RingSpec(
                name=f"mmsrv-{instance}-p{p}d{d}", num_pages=num_pages,
                page_shape=kv_page_shape(model, page_size),
                dtype=cfg.serving_dtype(model.raw), feature_rows=feature_rows, feature_dim=text.hidden_size, capacity=capacity,
                max_pages_per_handoff=max_pages, meta_bytes=meta_bytes,
            ))
    return specs
