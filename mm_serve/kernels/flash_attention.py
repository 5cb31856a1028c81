"""flash-attn backend (CUDA, extra ``[gpu]``): varlen prefill, paged decode where the kernel allows.

Prefill uses ``flash_attn_varlen_func`` over the flattened batch (Dao 2023,
FlashAttention-2); a prefill pass over a cached prefix takes the torch reference. Decode uses ``flash_attn_with_kvcache`` with a block table
when the page size is a multiple of 256 (upstream flash-attn's paged-KV
constraint); with smaller pages it falls back to the torch reference, which
also runs on CUDA. Selected by :func:`mm_serve.kernels.backend_select.select_attention_backend`
only on CUDA devices with ``flash_attn`` importable. Not exercised on the CPU CI.
"""

from __future__ import annotations

import torch

from mm_serve.kernels.attention_backend import AttentionBackend
from mm_serve.kernels.attention_metadata import AttentionMetadata
from mm_serve.kernels.paged_attention_ref import (
    TorchRefAttention,
    decode_attention_padded,
    decode_attention_ref,
    write_kv_ref,
)

FLASH_PAGE_MULTIPLE = 256


class FlashAttention(AttentionBackend):
    """The :class:`AttentionBackend` contract on flash-attn kernels (fp16/bf16 tensors on CUDA)."""

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping):  # type: ignore[no-untyped-def]
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale):  # type: ignore[no-untyped-def]
        write_kv_ref(key, value, k_cache, v_cache, meta.slot_mapping)
        if meta.has_prefix:  # a prefix-cache hit: the reference (runs on CUDA) reads the cached pages
            return TorchRefAttention.prefill_with_prefix(query, key, value, k_cache, v_cache, meta, scale)
        if meta.is_prefill:
            lens = torch.tensor(meta.seq_lens, device=query.device, dtype=torch.int32)
            cu = torch.zeros(len(meta.seq_lens) + 1, device=query.device, dtype=torch.int32)
            cu[1:] = torch.cumsum(lens, 0)
            longest = max(meta.seq_lens)
            return self._varlen(query, key, value, cu, cu, longest, longest, softmax_scale=scale, causal=True)
        if meta.block_tables is None or meta.context_lens is None:
            raise ValueError("decode attention needs block_tables and context_lens")
        if k_cache.shape[1] % FLASH_PAGE_MULTIPLE:
            if meta.graph_safe:
                return decode_attention_padded(query, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
            return decode_attention_ref(query, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        out = self._with_kvcache(
            query[:, None], k_cache, v_cache, cache_seqlens=meta.context_lens.to(torch.int32),
            block_table=meta.block_tables.to(torch.int32), softmax_scale=scale, causal=True,
        )
        return out[:, 0]
