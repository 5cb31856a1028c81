"""Per-step attention metadata: where each new token's K/V goes and what it attends to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Describes one forward pass over a flattened batch of ``T`` new tokens.

    Prefill (``is_prefill=True``): ``seq_lens[i]`` new tokens of sequence ``i``
    are laid out back to back; each sequence attends causally to its own new
    tokens, and, when ``prefix_lens[i] > 0`` (a prefix-cache hit), first to the
    ``prefix_lens[i]`` tokens already in its pages (``block_tables`` row ``i``):
    new token ``j`` sits at position ``prefix_lens[i] + j`` and sees positions
    ``0 .. prefix_lens[i] + j``.

    Decode (``is_prefill=False``): one new token per sequence (``T == B``); it
    attends to the first ``context_lens[i]`` tokens of the sequence in the
    paged cache, its own K/V included (written before attention runs).

    Mixed (a prefill description with ``decode`` set): the pass's ``T`` rows are this
    prefill's tokens, then one token per sequence of ``decode`` (a decode description).
    The layers run their projections and MLP over all ``T`` rows at once and each part's
    attention on its own rows (``LlamaAttention``): chunked prefill fused with decode
    (Agrawal et al., Sarathi-Serve, OSDI 2024).
    """

    is_prefill: bool
    seq_lens: list[int]  # new tokens per sequence in this pass; sum == T
    slot_mapping: torch.Tensor  # [T] int64: page_id * page_size + offset for each new token
    block_tables: torch.Tensor | None = None  # decode, prefill over a prefix: [B, max_pages] int64, padded with 0
    prefix_lens: list[int] | None = None  # prefill: tokens of each sequence already in the cache (None: all 0)
    context_lens: torch.Tensor | None = None  # decode: [B] int64, tokens in cache incl. the new one
    graph_safe: bool = False  # decode: static shapes, no host reads (the pass is captured in a CUDA graph)
    plan: dict[str, Any] = field(default_factory=dict)  # what a backend derives once per pass, reused by every layer
    decode: AttentionMetadata | None = None  # mixed pass: the decode rows that follow this prefill's rows

    @property
    def has_prefix(self) -> bool:
        """A prefill pass in which some sequence attends to cached KV before its new tokens."""
        return self.is_prefill and self.prefix_lens is not None and any(self.prefix_lens)

    @property
    def num_tokens(self) -> int:
        """Rows of the pass this description covers (a mixed pass's prefill rows only)."""
        return int(self.slot_mapping.shape[0])
