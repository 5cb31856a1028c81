"""KV page copies between an engine's paged cache and a cross-modal ring's page pool.

Both sides store pages the same way, page-major, so one page of every layer is
one contiguous block (``L * 2 * S * H * D`` elements):

* engine cache ``kv_data``: ``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]``
  (as :class:`mm_serve.runtime.kv_cache.PagedKVCache` stores it);
* ring pool ``ring_pages``: ``[num_ring_pages, num_layers, 2, page_size, num_kv_heads, head_dim]``.

Page ``i`` of the transfer moves ``src_page_ids[i]`` to ``dst_page_ids[i]``.
The fast versions copy every byte once, straight from source to destination
(no gathered temporary), run by run, a run being consecutive ids on the
destination side: one ``copy_`` when the source ids are consecutive too, else one
``index_select(out=...)``. Every run is a plain memory copy of whole pages
(an earlier layer-major engine layout made each page 2·L strided chunks and
the copies about twice as slow). The engine cache may live on another device
than the ring (a CUDA cache, a host shared-memory ring): runs then copy across
devices, a non-consecutive run gathered on the source device first. The
``*_ref`` versions are the plain advanced-indexing definitions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def copy_kv_to_ring(
    kv_data: torch.Tensor, src_page_ids: Sequence[int], ring_pages: torch.Tensor,
    dst_page_ids: Sequence[int],
) -> None:
    """Copy engine pages ``src_page_ids`` of ``kv_data`` into ring pages ``dst_page_ids`` (prefill side).

    Raises:
        ValueError: shapes or dtypes disagree, the id lists differ in
            length, an id is out of range, or a destination id repeats.
    """
    _check(kv_data, ring_pages, src_page_ids, dst_page_ids, ring_is_dst=True)
    _copy_pages(ring_pages, dst_page_ids, kv_data, src_page_ids)


def copy_kv_from_ring(
    ring_pages: torch.Tensor, src_page_ids: Sequence[int], kv_data: torch.Tensor,
    dst_page_ids: Sequence[int],
) -> None:
    """Copy ring pages ``src_page_ids`` into engine pages ``dst_page_ids`` of ``kv_data`` (decode side).

    Raises:
        ValueError: as :func:`copy_kv_to_ring`.
    """
    _check(kv_data, ring_pages, dst_page_ids, src_page_ids, ring_is_dst=False)
    _copy_pages(kv_data, dst_page_ids, ring_pages, src_page_ids)


def copy_kv_to_ring_ref(
    kv_data: torch.Tensor, src_page_ids: Sequence[int], ring_pages: torch.Tensor,
    dst_page_ids: Sequence[int],
) -> None:
    """Reference for :func:`copy_kv_to_ring` (gathers into a temporary first)."""
    src = torch.as_tensor(list(src_page_ids), dtype=torch.long, device=kv_data.device)
    ring_pages[list(dst_page_ids)] = kv_data[src]


def copy_kv_from_ring_ref(
    ring_pages: torch.Tensor, src_page_ids: Sequence[int], kv_data: torch.Tensor,
    dst_page_ids: Sequence[int],
) -> None:
    """Reference for :func:`copy_kv_from_ring` (gathers into a temporary first)."""
    src = torch.as_tensor(list(src_page_ids), dtype=torch.long, device=ring_pages.device)
    kv_data[list(dst_page_ids)] = ring_pages[src]


def _copy_pages(
    dst: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor, src_ids: Sequence[int]
) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for page-major tensors, one op per destination run."""
    n = len(dst_ids)
    i = 0
    while i < n:
        start = dst_ids[i]
        k = 1
        while i + k < n and dst_ids[i + k] == start + k:
            k += 1
        first = src_ids[i]
        if all(src_ids[i + j] == first + j for j in range(1, k)):
            dst[start:start + k].copy_(src[first:first + k])
        else:
            index = torch.as_tensor(src_ids[i:i + k], dtype=torch.long, device=src.device)
            if src.device == dst.device:
                torch.index_select(src, 0, index, out=dst[start:start + k])
            else:  # e.g. a CUDA cache and a host ring: gather on the source device, one transfer
                dst[start:start + k].copy_(src.index_select(0, index))
        i += k


def _check(
    kv_data: torch.Tensor, ring_pages: torch.Tensor, kv_ids: Sequence[int],
    ring_ids: Sequence[int], ring_is_dst: bool,
) -> None:
    if kv_data.dim() != 6 or ring_pages.dim() != 6 or kv_data.shape[2] != 2:
        raise ValueError(
            f"expected kv_data [P, L, 2, S, H, D] and ring_pages [N, L, 2, S, H, D], "
            f"got {tuple(kv_data.shape)} and {tuple(ring_pages.shape)}"
        )
    page = kv_data.shape[1:]
    if page != ring_pages.shape[1:]:
        raise ValueError(f"page shapes differ: engine {tuple(page)}, ring {tuple(ring_pages.shape[1:])}")
    if kv_data.dtype != ring_pages.dtype:
        raise ValueError(f"engine cache is {kv_data.dtype}, ring is {ring_pages.dtype}")
    if len(kv_ids) != len(ring_ids):
        raise ValueError(f"{len(kv_ids)} engine page ids but {len(ring_ids)} ring page ids")
    for ids, limit, side in ((kv_ids, kv_data.shape[0], "engine"), (ring_ids, ring_pages.shape[0], "ring")):
        if ids and not (0 <= min(ids) and max(ids) < limit):
            raise ValueError(f"{side} page ids out of range [0, {limit}): {list(ids)}")
    dst_ids = ring_ids if ring_is_dst else kv_ids
    if len(set(dst_ids)) != len(dst_ids):
        raise ValueError(f"destination page ids repeat: {list(dst_ids)}")
