"""The attention-backend contract that every implementation (torch reference, flash-attn) follows."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from mm_serve.kernels.attention_metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Attention over a paged KV cache.

    Cache layout (per layer): ``k_cache`` and ``v_cache`` are
    ``[num_pages, page_size, num_kv_heads, head_dim]``; token ``t`` of a
    sequence lives at page ``block_table[t // page_size]``, offset
    ``t % page_size``, i.e. flat slot ``page * page_size + offset``.

    Grouped-query attention: query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)`` (Ainslie et al. 2023, GQA).
    """

    @abstractmethod
    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store ``key``/``value`` ``[T, num_kv_heads, head_dim]`` at ``slot_mapping`` ``[T]`` (mutates the caches)."""

    @abstractmethod
    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        """Attention output ``[T, num_heads, head_dim]`` for ``query`` ``[T, num_heads, head_dim]``.

        ``key``/``value`` are this pass's new K/V ``[T, num_kv_heads, head_dim]``;
        implementations write them to the cache (:meth:`write_kv`) before reading it.
        Does not mutate anything else.
        """

    def fused_decode(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, k_cache: torch.Tensor,
        v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor | None:
        """A decode pass's attention straight from the fused QKV projection, or None.

        ``qkv`` ``[B, (num_heads + 2 num_kv_heads) * head_dim]`` (queries, keys, values);
        ``cos``/``sin`` ``[B, head_dim]``: the rotate-half RoPE of the model. A backend with
        a fused kernel applies RoPE, writes the new K/V and attends, returning
        ``[B, num_heads, head_dim]``; None (this default) means the caller applies RoPE and
        calls :meth:`forward`.
        """
        return None
