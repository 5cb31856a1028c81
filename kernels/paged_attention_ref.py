"""Plain-torch reference attention over a paged KV cache; runs on CPU and CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention_backend import AttentionBackend
from kernels.attention_metadata import AttentionMetadata


def write_kv_ref(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` ``[T, Hkv, D]`` into caches ``[P, S, Hkv, D]`` at flat slots ``[T]``.

    Slot ``s`` is token ``s % S`` of page ``s // S``. The caches may have any page
    stride (:class:`text_decode.kv_cache.PagedKVCache` hands out strided per-layer views).
    """
    page_size = k_cache.shape[1]
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size
    k_cache[pages, offsets] = key
    v_cache[pages, offsets] = value


def prefill_attention_ref(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq_lens: list[int], scale: float
) -> torch.Tensor:
    """Causal attention of each sequence over its own tokens.

    Args:
        query: ``[T, Hq, D]``; key, value: ``[T, Hkv, D]``; sequences back to back.
        seq_lens: tokens per sequence, summing to ``T``.
    Returns:
        ``[T, Hq, D]``.
    """
    group = query.shape[1] // key.shape[1]
    outputs = []
    start = 0
    for n in seq_lens:
        q = query[start : start + n].transpose(0, 1)
        k = key[start : start + n].transpose(0, 1)
        v = value[start : start + n].transpose(0, 1)
        if group > 1:
            k = k.repeat_interleave(group, dim=0)
            v = v.repeat_interleave(group, dim=0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        outputs.append(out.transpose(0, 1))
        start += n
    return torch.cat(outputs, dim=0)


MIN_GROUP_FILL = 0.5  # a decode group pads no sequence to more than twice its context


def length_groups(context_lens: list[int], min_fill: float = MIN_GROUP_FILL) -> list[list[int]]:
    """Batch rows grouped by context length, longest first, so that every row of a group has
    at least ``min_fill`` times the context of the group's longest row.

    Decode attention pads each row to the longest context it is batched with; grouping
    bounds that waste (at most ``1 / min_fill`` times the work per row) at the price of
    one kernel call per group, at most ``1 + log(max / min) / log(1 / min_fill)`` groups.
    """
    order = sorted(range(len(context_lens)), key=context_lens.__getitem__, reverse=True)
    groups: list[list[int]] = []
    for row in order:
        if groups and context_lens[row] >= min_fill * context_lens[groups[-1][0]]:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def decode_attention_ref(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, max_context_len: int, scale: float,
) -> torch.Tensor:
    """One query token per sequence attending to its paged context.

    Rows are attended in :func:`length_groups` (one group when the lengths are close),
    each group padded to its own longest context, so a long request does not make
    every short one in the batch pay for its length.

    Args:
        query: ``[B, Hq, D]``.
        k_cache, v_cache: ``[P, S, Hkv, D]``, any page stride.
        block_tables: ``[B, max_pages]`` page ids (padding entries are never read unmasked).
        context_lens: ``[B]`` tokens of context per sequence (>= 1).
        max_context_len: ``max(context_lens)`` as an int.
    Returns:
        ``[B, Hq, D]``.
    """
    lens = context_lens.tolist()
    groups = length_groups(lens) if len(lens) > 1 else [[0]]
    if len(groups) == 1:
        return _decode_attention_padded(query, k_cache, v_cache, block_tables, context_lens, max_context_len, scale)
    out = torch.empty_like(query)
    for rows in groups:
        index = torch.tensor(rows, dtype=torch.long, device=query.device)
        out[index] = _decode_attention_padded(
            query[index], k_cache, v_cache, block_tables[index], context_lens[index], lens[rows[0]], scale)
    return out


def _decode_attention_padded(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, max_context_len: int, scale: float,
) -> torch.Tensor:
    """:func:`decode_attention_ref` for one group: every row padded to ``max_context_len``."""
    batch, num_heads, head_dim = query.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_pages = -(-max_context_len // page_size)
    # Gather whole pages (index_select is several times faster than advanced indexing
    # on CPU), then cut every row to the longest context.
    pages = block_tables[:, :num_pages].reshape(-1)
    keys = torch.index_select(k_cache, 0, pages).view(
        batch, num_pages * page_size, num_kv_heads, head_dim)[:, :max_context_len]  # [B, L, Hkv, D]
    values = torch.index_select(v_cache, 0, pages).view(
        batch, num_pages * page_size, num_kv_heads, head_dim)[:, :max_context_len]
    positions = torch.arange(max_context_len, device=query.device)
    valid = (positions[None, :] < context_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(
        query[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=valid,
        scale=scale, enable_gqa=num_heads != num_kv_heads,
    )  # [B, Hq, 1, D]
    return out.reshape(batch, num_heads, head_dim)


class TorchRefAttention(AttentionBackend):
    """The reference backend: :func:`prefill_attention_ref` and :func:`decode_attention_ref`."""

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping):  # type: ignore[no-untyped-def]
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale):  # type: ignore[no-untyped-def]
        write_kv_ref(key, value, k_cache, v_cache, meta.slot_mapping)
        if meta.is_prefill:
            return prefill_attention_ref(query, key, value, meta.seq_lens, scale)
        if meta.block_tables is None or meta.context_lens is None:
            raise ValueError("decode attention needs block_tables and context_lens")
        return decode_attention_ref(
            query, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.max_context_len, scale
        )
