"""FlexAttention over the paged KV cache: decode, prefill and prefill over cached pages, one call per
layer, read in place through block masks built from the block tables (no padded gather).

PyTorch's FlexAttention (``torch.nn.attention.flex_attention``; He et al. 2024, "FlexAttention: The
Flexibility of PyTorch with the Performance of FlashAttention") takes a *block mask*: for every
block of queries, the list of key blocks it reads, and a ``mask_mod`` for the positions inside
partial blocks. Here a key block is one KV page, so a sequence's block table *is* its list of
key blocks, and a page shared by several sequences (a prefix-cache hit) is read by each from the
same memory.

How the cache is presented. :class:`~mm_serve.runtime.kv_cache.PagedKVCache` is page-major: a
layer's keys are ``[P, S, Hkv, D]`` with a page stride of ``R = num_layers * 2 * S`` token
rows. FlexAttention wants ``[batch, Hkv, kv_len, D]``, so the layer's keys are viewed (no copy)
as one long *virtual* sequence with a token stride of ``Hkv * D``: virtual token ``v`` is row
``v % R`` of page ``v // R``, and page ``p``'s ``S`` keys are virtual block ``p * R / S``. The
other layers' rows between them are never listed in a block mask and are masked out by
``mask_mod``, which checks, for virtual key ``v`` and query ``q`` of sequence ``s``:
the block is the first of its page, the page is in ``s``'s block table (at logical index
``lp``, from a per-sequence page -> logical-index table), and ``lp * S + v % S`` is at or
before ``q``'s position.

Two layouts:

* decode: batch ``B`` rows of one query each (``[B, Hq, 1, D]``), row ``b``'s key blocks are its
  block table's first ``ceil(context / S)`` pages, the full ones listed as full (no ``mask_mod``).
  Built from tensors only (no host reads), so it can be captured in a CUDA graph.
* prefill: the whole batch's new tokens back to back as one row (``[1, Hq, T, D]``; varlen /
  document masking), each query block listing the pages of the sequences it holds up to its
  causal limit. One call per layer for the whole prefill batch, with or without cached prefixes
  (chunked prefill's earlier chunks are a cached prefix).

Eager FlexAttention (``compiled=False``, what CPU tests run) computes the same function from dense
scores; compiled (``torch.compile``, the CUDA default) generates a fused kernel that visits only
the listed blocks. The torch reference (:mod:`mm_serve.kernels.paged_attention_ref`) is what
both are tested against.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mm_serve.kernels.attention_metadata import AttentionMetadata
from mm_serve.kernels.paged_attention_ref import TorchRefAttention

PREFILL_Q_BLOCK = 128  # queries per block of a prefill block mask (FlexAttention's default block size)


def _flex_module() -> Any:
    """``torch.nn.attention.flex_attention`` (PyTorch >= 2.5), imported on first use."""
    from torch.nn.attention import flex_attention

    return flex_attention


def flex_available() -> bool:
    """Whether this PyTorch has FlexAttention with :meth:`BlockMask.from_kv_blocks`."""
    try:
        module = _flex_module()
    except ImportError:
        return False
    return hasattr(module, "flex_attention") and hasattr(module.BlockMask, "from_kv_blocks")


@dataclass(frozen=True)
class CacheGeometry:
    """Where a layer's pages sit in its virtual key sequence (module docstring).

    ``page_size`` S tokens per page; ``row_stride`` R token rows from one page to the next;
    ``num_pages`` pages (scratch included); ``blocks_per_page`` R / S virtual blocks per page;
    ``kv_len`` the virtual length, ``(num_pages - 1) * R + S``; ``num_blocks`` its blocks.
    """

    page_size: int
    row_stride: int
    num_pages: int

    @property
    def blocks_per_page(self) -> int:
        return self.row_stride // self.page_size

    @property
    def kv_len(self) -> int:
        return (self.num_pages - 1) * self.row_stride + self.page_size

    @property
    def num_blocks(self) -> int:
        return (self.num_pages - 1) * self.blocks_per_page + 1

    @classmethod
    def of(cls, cache: torch.Tensor) -> CacheGeometry:
        """The geometry of a layer's key (or value) cache ``[P, S, Hkv, D]`` (any page stride that is a
        whole number of pages' worth of rows).

        Raises:
            ValueError: rows inside a page are not contiguous, or the page stride is not a multiple of a page.
        """
        pages, size, heads, dim = cache.shape
        row = heads * dim
        if cache.stride()[1:] != (row, dim, 1) or cache.stride(0) % (row * size):
            raise ValueError(f"a paged cache [P, S, Hkv, D] with contiguous pages is needed, got strides {cache.stride()}")
        return cls(size, cache.stride(0) // row, pages)


def virtual_keys(cache: torch.Tensor, geometry: CacheGeometry, batch: int) -> torch.Tensor:
    """A layer's cache ``[P, S, Hkv, D]`` viewed (no copy) as ``[batch, Hkv, kv_len, D]`` (batch rows
    share the storage: stride 0)."""
    _, _, heads, dim = cache.shape
    return torch.as_strided(
        cache, (batch, heads, geometry.kv_len, dim), (0, dim, heads * dim, 1), cache.storage_offset(),
    )


def logical_index(block_tables: torch.Tensor, lengths: torch.Tensor, num_pages: int, page_size: int) -> torch.Tensor:
    """Per sequence, each physical page's logical index in it: ``[B, num_pages]`` int32, -1 for pages
    it does not hold. ``block_tables`` ``[B, W]`` page ids; ``lengths`` ``[B]`` tokens each sequence
    holds (entries past ``ceil(length / page_size)`` are padding and stay -1). Tensor ops only."""
    rows, width = block_tables.shape
    device = block_tables.device
    logical = torch.arange(width, device=device, dtype=torch.int32).expand(rows, width)
    used = logical < (lengths[:, None] + page_size - 1) // page_size
    table = torch.full((rows, num_pages + 1), -1, dtype=torch.int32, device=device)
    # padding entries land in an extra column that is cut off
    target = torch.where(used, block_tables, torch.full_like(block_tables, num_pages))
    table.scatter_(1, target.long(), torch.where(used, logical, torch.full_like(logical, -1)))
    return table[:, :num_pages]


def _page_mask(geometry: CacheGeometry, owner: Callable[[Any, Any], Any], position: Callable[[Any, Any], Any],
               pages_of: torch.Tensor) -> Callable[..., Any]:
    """The ``mask_mod`` (module docstring): query ``q`` of batch row ``b`` sees virtual key ``v`` when
    ``v`` is a key of a page of sequence ``owner(b, q)`` at a logical position <= ``position(b, q)``."""
    size, per_page = geometry.page_size, geometry.blocks_per_page

    def mask_mod(b: Any, h: Any, q: Any, v: Any) -> Any:
        block = v // size
        lp = pages_of[owner(b, q), block // per_page]
        return (block % per_page == 0) & (lp >= 0) & (lp * size + v % size <= position(b, q))

    return mask_mod


def decode_block_mask(block_tables: torch.Tensor, context_lens: torch.Tensor, geometry: CacheGeometry) -> Any:
    """The decode :class:`BlockMask`: row ``b`` (one query at position ``context_lens[b] - 1``) reads
    its first ``ceil(context_lens[b] / S)`` pages, the last one through ``mask_mod`` when partial.

    Args:
        block_tables: ``[B, W]`` page ids (W <= pages). context_lens: ``[B]`` tokens (>= 1), own K/V included.
    """
    flex = _flex_module()
    rows, width = block_tables.shape
    device = block_tables.device
    size, per_page = geometry.page_size, geometry.blocks_per_page
    tables = block_tables.to(torch.int32) * per_page
    full = (context_lens // size).to(torch.int32)  # pages every position of which is visible
    partial = (context_lens % size != 0).to(torch.int32)
    full_indices = torch.zeros(rows, 1, 1, geometry.num_blocks, dtype=torch.int32, device=device)
    full_indices[:, 0, 0, :width] = tables
    last = torch.gather(tables, 1, full.clamp(max=width - 1).long()[:, None])  # [B, 1]: the partial page
    partial_indices = torch.zeros(rows, 1, 1, geometry.num_blocks, dtype=torch.int32, device=device)
    partial_indices[:, 0, 0, :1] = last
    pages_of = logical_index(block_tables, context_lens, geometry.num_pages, size)
    ends = context_lens - 1
    mask_mod = _page_mask(geometry, lambda b, q: b, lambda b, q: ends[b], pages_of)
    return flex.BlockMask.from_kv_blocks(
        partial[:, None, None], partial_indices, full[:, None, None], full_indices,
        BLOCK_SIZE=(1, size), mask_mod=mask_mod, seq_lengths=(1, geometry.kv_len), compute_q_blocks=False,
    )


def prefill_block_mask(
    seq_lens: list[int], prefix_lens: list[int], block_tables: list[list[int]], geometry: CacheGeometry,
    device: torch.device, q_block: int = PREFILL_Q_BLOCK,
) -> Any:
    """The prefill :class:`BlockMask` for ``T = sum(seq_lens)`` queries back to back: query ``j`` of
    sequence ``i`` sits at position ``prefix_lens[i] + j`` and reads sequence ``i``'s pages
    (``block_tables[i]``) up to it. A page is listed as full for a query block that holds one
    sequence only and sees the whole page; every other listed page goes through ``mask_mod``, and a
    page that several of the block's sequences share (a prefix-cache hit) is listed once.
    Built on the host (a prefill pass is never graph-captured), once per pass.
    """
    flex = _flex_module()
    size, per_page = geometry.page_size, geometry.blocks_per_page
    total = sum(seq_lens)
    num_q_blocks = -(-total // q_block)
    owner = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    partial_rows: list[list[int]] = []
    full_rows: list[list[int]] = []
    for qb in range(num_q_blocks):
        lo, hi = qb * q_block, min(total, (qb + 1) * q_block)  # queries [lo, hi)
        first, last = int(owner[lo]), int(owner[hi - 1])
        partial: list[int] = []
        full: list[int] = []
        alone = first == last  # only then can a page be full for every query of the block
        for s in range(first, last + 1):
            q_lo, q_hi = max(lo, starts[s]), min(hi, starts[s + 1])  # this sequence's queries in the block
            low_pos = prefix_lens[s] + q_lo - starts[s]
            high_pos = prefix_lens[s] + q_hi - 1 - starts[s]
            for lp in range(high_pos // size + 1):
                block = block_tables[s][lp] * per_page
                (full if alone and (lp + 1) * size - 1 <= low_pos else partial).append(block)
        # a page shared by sequences of this block is listed once: a fused kernel would visit it twice
        partial_rows.append(sorted(set(partial)))
        full_rows.append(full)

    def indices(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        counts = torch.tensor([len(r) for r in rows], dtype=torch.int32)
        table = torch.zeros(1, 1, num_q_blocks, geometry.num_blocks, dtype=torch.int32)
        for i, r in enumerate(rows):
            table[0, 0, i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        return counts.view(1, 1, -1).to(device), table.to(device)

    widest = max(len(t) for t in block_tables)
    padded = torch.tensor([t + [0] * (widest - len(t)) for t in block_tables], dtype=torch.long, device=device)
    held = torch.tensor([p + n for p, n in zip(prefix_lens, seq_lens, strict=True)], device=device)
    pages_of = logical_index(padded, held, geometry.num_pages, size)
    owner_dev = owner.to(device)
    position = (torch.tensor(prefix_lens, device=device)[owner_dev]
                + torch.arange(total, device=device) - torch.tensor(starts[:-1], device=device)[owner_dev])
    mask_mod = _page_mask(geometry, lambda b, q: owner_dev[q], lambda b, q: position[q], pages_of)
    return flex.BlockMask.from_kv_blocks(
        *indices(partial_rows), *indices(full_rows), BLOCK_SIZE=(q_block, size), mask_mod=mask_mod,
        seq_lengths=(total, geometry.kv_len), compute_q_blocks=False,  # forward only: no query-side transpose
    )


class FlexPagedAttention(TorchRefAttention):
    """The :class:`~mm_serve.kernels.attention_backend.AttentionBackend` contract on FlexAttention
    (module docstring). Writes K/V as the reference does; reads every pass's keys and values in
    place from the paged cache, one FlexAttention call per layer.

    ``compiled``: run ``torch.compile(flex_attention)`` (a fused kernel; on CUDA the reason to use
    this backend) instead of eager FlexAttention (dense scores over every page of the cache: exact,
    but memory and time grow with the whole cache, so for CPU tests only). ``dynamic``: compile for
    dynamic shapes (the default: every prefill length and decode batch would otherwise compile a
    kernel of its own, and past torch's recompile limit fall back to eager); the CPU tests compile
    static shapes, as torch 2.14's CPU template miscompiles dynamic prefill shapes.

    Raises:
        RuntimeError: this PyTorch has no FlexAttention (checked at construction).
    """

    def __init__(self, compiled: bool = False, dynamic: bool = True) -> None:
        if not flex_available():
            raise RuntimeError("FlexAttention needs PyTorch >= 2.5 (torch.nn.attention.flex_attention)")
        flex = _flex_module().flex_attention
        self.compiled = compiled
        if not compiled:  # eager is chosen knowingly here (exact, for CPU tests): no warning per process
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile", category=UserWarning)
        self._attend = torch.compile(flex, dynamic=dynamic) if compiled else flex

    def forward(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale):  # type: ignore[no-untyped-def]
        self.write_pass_kv(key, value, k_cache, v_cache, meta)
        if "flex" not in meta.plan:  # the first layer of the pass builds the mask every layer reuses
            meta.plan["flex"] = self._plan(k_cache, meta)
        geometry, block_mask = meta.plan["flex"]
        gqa = query.shape[1] != k_cache.shape[2]
        if meta.is_prefill:
            batch, queries = 1, query.transpose(0, 1)[None]  # [1, Hq, T, D]
        else:
            batch, queries = query.shape[0], query[:, :, None]  # [B, Hq, 1, D]
        out = self._attend(
            queries, virtual_keys(k_cache, geometry, batch), virtual_keys(v_cache, geometry, batch),
            block_mask=block_mask, scale=scale, enable_gqa=gqa,
        )
        return out[0].transpose(0, 1) if meta.is_prefill else out[:, :, 0]

    @staticmethod
    def _plan(k_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[CacheGeometry, Any]:
        """This pass's :class:`CacheGeometry` and block mask.

        Raises:
            ValueError: a decode pass without block tables or context lengths.
        """
        geometry = CacheGeometry.of(k_cache)
        if not meta.is_prefill:
            if meta.block_tables is None or meta.context_lens is None:
                raise ValueError("decode attention needs block_tables and context_lens")
            return geometry, decode_block_mask(meta.block_tables, meta.context_lens, geometry)
        prefix_lens = meta.prefix_lens or [0] * len(meta.seq_lens)
        if any(prefix_lens) and meta.block_tables is None:
            raise ValueError("prefill over a cached prefix needs block_tables and prefix_lens")
        if meta.block_tables is not None:
            tables = [row[: -(-(p + n) // geometry.page_size)] for row, p, n in
                      zip(meta.block_tables.tolist(), prefix_lens, meta.seq_lens, strict=True)]
        else:  # no prefix: the pages are where this pass's slots put them
            tables = _tables_from_slots(meta.slot_mapping, meta.seq_lens, geometry.page_size)
        return geometry, prefill_block_mask(meta.seq_lens, prefix_lens, tables, geometry, k_cache.device)


def _tables_from_slots(slot_mapping: torch.Tensor, seq_lens: list[int], page_size: int) -> list[list[int]]:
    """Block tables of sequences prefilled from position 0: each one's pages in order of its tokens'
    slots (``slot_mapping`` ``[T]``, token ``j`` of a sequence at slot ``page * S + j % S``)."""
    pages = (slot_mapping // page_size).tolist()
    tables, start = [], 0
    for n in seq_lens:
        tables.append(pages[start: start + n: page_size])
        start += n
    return tables
