"""CPU backend: decode attention from the compiled in-place kernel, the rest from the torch reference."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.paged_attention_ref import TorchRefAttention


class CompiledCpuAttention(TorchRefAttention):
    """:class:`TorchRefAttention` whose float32 CPU decode reads the paged cache in place.

    ``op`` is :func:`kernels.cpu_attention_ext.paged_decode_attention_op`'s kernel
    (``kernels/csrc/paged_decode_attention_cpu.cpp``): no gather of each row's pages into a
    padded copy, no mask, one pass over K and one over V per (sequence, KV head). Prefill,
    other dtypes and devices, and graph-captured passes take the reference path.
    """

    def __init__(self, op: Callable[..., torch.Tensor]) -> None:
        self._op = op

    def decode(  # type: ignore[no-untyped-def]
        self, query, k_cache, v_cache, meta: AttentionMetadata, scale,
    ) -> torch.Tensor:
        if meta.graph_safe or query.dtype != torch.float32 or query.device.type != "cpu":
            return super().decode(query, k_cache, v_cache, meta, scale)
        assert meta.block_tables is not None and meta.context_lens is not None
        return self._op(query.contiguous(), k_cache, v_cache, meta.block_tables, meta.context_lens, float(scale))
