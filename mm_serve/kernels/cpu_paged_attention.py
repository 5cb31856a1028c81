"""CPU backend: decode attention from the compiled in-place kernels, the rest from the torch reference."""

from __future__ import annotations

from typing import Any

import torch

from mm_serve.kernels.attention_metadata import AttentionMetadata
from mm_serve.kernels.paged_attention_ref import TorchRefAttention


class CompiledCpuAttention(TorchRefAttention):
    """:class:`TorchRefAttention` whose float32 CPU decode reads the paged cache in place.

    ``ops`` is :func:`mm_serve.kernels.cpu_extension.cpu_kernel_ops`'s namespace
    (``kernels/csrc/paged_decode_attention_cpu.cpp``): no gather of each row's pages into a
    padded copy, no mask, one pass over K and one over V per (sequence, KV head); the fused
    op also applies RoPE and writes the new K/V. Prefill, other dtypes and devices, and
    graph-captured passes take the reference path.
    """

    def __init__(self, ops: Any) -> None:
        self.ops = ops  # torch.ops.mm_serve_cpu

    @staticmethod
    def _applies(x: torch.Tensor, meta: AttentionMetadata) -> bool:
        return not meta.is_prefill and not meta.graph_safe and x.dtype == torch.float32 and x.device.type == "cpu"

    def decode(  # type: ignore[no-untyped-def]
        self, query, k_cache, v_cache, meta: AttentionMetadata, scale,
    ) -> torch.Tensor:
        if not self._applies(query, meta):
            return super().decode(query, k_cache, v_cache, meta, scale)
        assert meta.block_tables is not None and meta.context_lens is not None
        return self.ops.paged_decode_attention(
            query.contiguous(), k_cache, v_cache, meta.block_tables, meta.context_lens, float(scale),
        )

    def fused_decode(  # type: ignore[no-untyped-def]
        self, qkv, cos, sin, num_heads, k_cache, v_cache, meta: AttentionMetadata, scale,
    ) -> torch.Tensor | None:
        if not self._applies(qkv, meta) or meta.block_tables is None or meta.context_lens is None:
            return None
        return self.ops.rope_paged_decode_attention(
            qkv.contiguous(), cos.contiguous(), sin.contiguous(), num_heads, k_cache, v_cache,
            meta.block_tables, meta.context_lens, float(scale),
        )
