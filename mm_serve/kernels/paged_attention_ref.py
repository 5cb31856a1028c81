"""Plain-torch reference attention over a paged KV cache; runs on CPU and CUDA."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mm_serve.kernels.attention_backend import AttentionBackend
from mm_serve.kernels.attention_metadata import AttentionMetadata


def write_kv_ref(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` ``[T, Hkv, D]`` into caches ``[P, S, Hkv, D]`` at flat slots ``[T]``.

    Slot ``s`` is token ``s % S`` of page ``s // S``. The caches may have any page
    stride (:class:`mm_serve.runtime.kv_cache.PagedKVCache` hands out strided per-layer views).
    """
    page_size = k_cache.shape[1]
    scatter_kv(key, value, k_cache, v_cache, slot_mapping // page_size, slot_mapping % page_size)


def scatter_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    pages: torch.Tensor, offsets: torch.Tensor,
) -> None:
    """:func:`write_kv_ref` with the slots already split into page ids and in-page offsets ``[T]``."""
    k_cache[pages, offsets] = key
    v_cache[pages, offsets] = value


def prefill_attention_ref(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq_lens: list[int], scale: float
) -> torch.Tensor:
    """Causal attention of each sequence over its own tokens.

    Consecutive sequences of the same length (a batch of same-size images with the
    same question, say) go through one batched kernel call; the result is the same
    as one call per sequence.

    Args:
        query: ``[T, Hq, D]``; key, value: ``[T, Hkv, D]``; sequences back to back.
        seq_lens: tokens per sequence, summing to ``T``.
    Returns:
        ``[T, Hq, D]``.
    """
    group = query.shape[1] // key.shape[1]
    outputs = []
    start = 0
    i = 0
    while i < len(seq_lens):
        n = seq_lens[i]
        count = 1
        while i + count < len(seq_lens) and seq_lens[i + count] == n:
            count += 1
        end = start + count * n
        q, k, v = (x[start:end].unflatten(0, (count, n)).transpose(1, 2) for x in (query, key, value))
        if group > 1:  # [count, H, n, D]
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        outputs.append(out.transpose(1, 2).flatten(0, 1))
        start = end
        i += count
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


def prefill_attention_prefix_ref(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: list[int], prefix_lens: list[int], scale: float,
) -> torch.Tensor:
    """Causal prefill attention of sequences whose first ``prefix_lens[i]`` tokens are cached.

    Sequence ``i``'s ``seq_lens[i]`` new queries sit at positions ``prefix_lens[i] ..``; each
    attends to the cached keys of its pages (``block_tables`` row ``i``) and to the new keys
    up to its own position. Sequences with no prefix go through
    :func:`prefill_attention_ref`. The new K/V must already be in the cache.

    Args:
        query: ``[T, Hq, D]``; key, value: ``[T, Hkv, D]`` (this pass's, back to back).
        k_cache, v_cache: ``[P, S, Hkv, D]``, any page stride.
        block_tables: ``[B, max_pages]`` page ids. seq_lens, prefix_lens: ``[B]`` tokens.
    Returns:
        ``[T, Hq, D]``.
    """
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_heads, head_dim = query.shape[1], query.shape[2]
    out = torch.empty_like(query)
    start = 0
    for i, (n, cached) in enumerate(zip(seq_lens, prefix_lens, strict=True)):
        end = start + n
        if not cached:
            out[start:end] = prefill_attention_ref(query[start:end], key[start:end], value[start:end], [n], scale)
            start = end
            continue
        total = cached + n
        pages = block_tables[i, : -(-total // page_size)]
        keys = torch.index_select(k_cache, 0, pages).reshape(-1, num_kv_heads, head_dim)[:total]
        values = torch.index_select(v_cache, 0, pages).reshape(-1, num_kv_heads, head_dim)[:total]
        rows = torch.arange(cached, total, device=query.device)
        visible = torch.arange(total, device=query.device)[None, :] <= rows[:, None]  # [n, total]
        attended = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=visible[None, None], scale=scale, enable_gqa=num_heads != num_kv_heads,
        )  # [1, Hq, n, D]
        out[start:end] = attended[0].transpose(0, 1)
        start = end
    return out


MIN_GROUP_FILL = 0.5  # a decode group pads no sequence to more than twice its context ...
MIN_SPLIT_CONTEXT = 256  # ... once the group's longest context reaches this many tokens


def length_groups(
    context_lens: list[int], min_fill: float = MIN_GROUP_FILL, min_split: int = MIN_SPLIT_CONTEXT
) -> list[list[int]]:
    """Batch rows grouped by context length, longest first.

    Decode attention pads each row to the longest context it is batched with; grouping
    bounds that waste at the price of one kernel call per group. A row starts a new
    group when its context is below ``min_fill`` times the current group's longest
    and that longest is at least ``min_split`` tokens; below ``min_split`` padding
    costs less than another call, so the rest of the batch joins the group. Hence
    every row of a group whose longest row has ``n >= min_split`` tokens has at least
    ``min_fill * n`` tokens, and there are at most ``1 + log(max / min_split) /
    log(1 / min_fill)`` groups.
    """
    order = sorted(range(len(context_lens)), key=context_lens.__getitem__, reverse=True)
    groups: list[list[int]] = []
    for row in order:
        if groups:
            longest = context_lens[groups[-1][0]]
            if longest < min_split or context_lens[row] >= min_fill * longest:
                groups[-1].append(row)
                continue
        groups.append([row])
    return groups


@dataclass(frozen=True)
class DecodeGroup:
    """One kernel call of :func:`decode_attention_ref`: rows padded to ``max_len``.

    ``rows`` ``[b]`` are the batch rows (None: the whole batch in order), ``pages``
    ``[b * num_pages]`` their page ids row by row, ``valid`` ``[b, 1, 1, max_len]`` the
    mask of real context positions.
    """

    rows: torch.Tensor | None
    pages: torch.Tensor
    valid: torch.Tensor
    max_len: int


def plan_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, page_size: int) -> list[DecodeGroup]:
    """The :class:`DecodeGroup` calls for one decode pass; the same for every layer, so a
    backend computes it once per pass (``AttentionMetadata.plan``).

    Args:
        block_tables: ``[B, max_pages]`` page ids. context_lens: ``[B]`` tokens (>= 1).
        page_size: tokens per page.
    """
    lens = context_lens.tolist()
    groups = length_groups(lens) if len(lens) > 1 else [[0]]
    plan = []
    for rows in groups:
        index = None if len(groups) == 1 else torch.tensor(rows, dtype=torch.long, device=block_tables.device)
        tables = block_tables if index is None else block_tables[index]
        group_lens = context_lens if index is None else context_lens[index]
        max_len = lens[rows[0]]  # rows are sorted longest first
        num_pages = -(-max_len // page_size)
        positions = torch.arange(max_len, device=block_tables.device)
        valid = (positions[None, :] < group_lens[:, None])[:, None, None, :]
        plan.append(DecodeGroup(index, tables[:, :num_pages].reshape(-1), valid, max_len))
    return plan


def decode_attention_ref(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, plan: list[DecodeGroup] | None = None,
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
        plan: :func:`plan_decode` of these tables and lengths, if already computed.
    Returns:
        ``[B, Hq, D]``.
    """
    if plan is None:
        plan = plan_decode(block_tables, context_lens, k_cache.shape[1])
    if len(plan) == 1:
        return _attend_group(query, k_cache, v_cache, plan[0], scale)
    out = torch.empty_like(query)
    for group in plan:
        out[group.rows] = _attend_group(query[group.rows], k_cache, v_cache, group, scale)
    return out


def decode_attention_padded(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """:func:`decode_attention_ref` with static shapes and no host synchronisation.

    Every row attends over all ``max_pages * S`` positions of its block table, masked
    to its ``context_lens``; no grouping and no Python reads of device values, so the
    call can be captured in a CUDA graph (``mm_serve.runtime.decode_graphs``) and
    replayed for any contents of the same shapes. Masked positions must hold finite
    values (the caches start zeroed and only ever receive finite K/V).

    Args:
        query: ``[B, Hq, D]``. k_cache, v_cache: ``[P, S, Hkv, D]``.
        block_tables: ``[B, max_pages]`` page ids, every entry a valid page.
        context_lens: ``[B]`` tokens of context per sequence (>= 1).
    Returns:
        ``[B, Hq, D]``.
    """
    width = block_tables.shape[1] * k_cache.shape[1]
    positions = torch.arange(width, device=query.device)
    valid = (positions[None, :] < context_lens[:, None])[:, None, None, :]
    return _attend_pages(query, k_cache, v_cache, block_tables.reshape(-1), width, valid, scale)


def _attend_group(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup, scale: float
) -> torch.Tensor:
    """Attention of ``query`` ``[b, Hq, D]`` over the gathered, padded pages of one group."""
    return _attend_pages(query, k_cache, v_cache, group.pages, group.max_len, group.valid, scale)


def _attend_pages(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor, length: int,
    valid: torch.Tensor, scale: float,
) -> torch.Tensor:
    """``query`` ``[b, Hq, D]`` attending to the first ``length`` positions of its rows' pages
    (``pages`` ``[b * pages_per_row]``, row by row), masked by ``valid`` ``[b, 1, 1, length]``."""
    batch, num_heads, head_dim = query.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    width = pages.shape[0] // batch * page_size
    # Gather whole pages (index_select is several times faster than advanced indexing
    # on CPU), then cut every row to ``length``.
    keys = torch.index_select(k_cache, 0, pages).view(batch, width, num_kv_heads, head_dim)[:, :length]  # [b, L, Hkv, D]
    values = torch.index_select(v_cache, 0, pages).view(batch, width, num_kv_heads, head_dim)[:, :length]
    out = F.scaled_dot_product_attention(
        query[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=valid,
        scale=scale, enable_gqa=num_heads != num_kv_heads,
    )  # [b, Hq, 1, D]
    return out.reshape(batch, num_heads, head_dim)


class TorchRefAttention(AttentionBackend):
    """The reference backend: :func:`prefill_attention_ref` and :func:`decode_attention_ref`."""

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping):  # type: ignore[no-untyped-def]
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping)

    @staticmethod
    def write_pass_kv(  # type: ignore[no-untyped-def]
        key, value, k_cache, v_cache, meta: AttentionMetadata,
    ) -> None:
        """Store this pass's ``key``/``value`` ``[T, Hkv, D]`` at ``meta.slot_mapping``; the page ids and
        offsets are derived by the pass's first layer and kept in ``meta.plan`` for the others."""
        if "slots" not in meta.plan:
            page_size = k_cache.shape[1]
            meta.plan["slots"] = (meta.slot_mapping // page_size, meta.slot_mapping % page_size)
        scatter_kv(key, value, k_cache, v_cache, *meta.plan["slots"])

    def forward(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale):  # type: ignore[no-untyped-def]
        self.write_pass_kv(key, value, k_cache, v_cache, meta)
        if meta.has_prefix:
            return self.prefill_with_prefix(query, key, value, k_cache, v_cache, meta, scale)
        if meta.is_prefill:
            return prefill_attention_ref(query, key, value, meta.seq_lens, scale)
        if meta.block_tables is None or meta.context_lens is None:
            raise ValueError("decode attention needs block_tables and context_lens")
        return self.decode(query, k_cache, v_cache, meta, scale)

    @staticmethod
    def prefill_with_prefix(  # type: ignore[no-untyped-def]
        query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale,
    ) -> torch.Tensor:
        """Prefill attention of a pass with cached prefixes (:func:`prefill_attention_prefix_ref`),
        once the pass's K/V are in the cache.

        Raises:
            ValueError: ``meta`` lacks the block tables or prefix lengths.
        """
        if meta.block_tables is None or meta.prefix_lens is None:
            raise ValueError("prefill over a cached prefix needs block_tables and prefix_lens")
        return prefill_attention_prefix_ref(
            query, key, value, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.prefix_lens, scale,
        )

    def decode(  # type: ignore[no-untyped-def]
        self, query, k_cache, v_cache, meta: AttentionMetadata, scale,
    ) -> torch.Tensor:
        """Decode attention ``[B, Hq, D]`` once this pass's K/V are in the cache (``meta`` has tables and lengths)."""
        assert meta.block_tables is not None and meta.context_lens is not None
        page_size = k_cache.shape[1]
        if meta.graph_safe:
            return decode_attention_padded(query, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        if "decode" not in meta.plan:
            meta.plan["decode"] = plan_decode(meta.block_tables, meta.context_lens, page_size)
        return decode_attention_ref(
            query, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, plan=meta.plan["decode"],
        )
