"""Tensor storage of the paged KV cache, with its :class:`PagePool` of ids."""

from __future__ import annotations

import torch

from mm_serve.kernels.page_pool import PagePool
from mm_serve.runtime.huge_pages import huge_page_zeros


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens (ceil division)."""
    return -(-num_tokens // page_size)


class PagedKVCache:
    """KV pages for every layer: ``data`` is ``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]``.

    Page-major, the layout of the cross-modal ring's page pool: a page holds every
    layer's keys and values of its ``page_size`` tokens in one contiguous block, so
    a KV hand-off moves whole pages with plain memory copies
    (:mod:`mm_serve.transport.kv_transfer`). ``data[:, l, 0]`` / ``data[:, l, 1]`` are layer
    ``l``'s key / value caches, each ``[num_pages, page_size, num_kv_heads, head_dim]``
    with a page stride of ``num_layers * 2 * page_size * num_kv_heads * head_dim``
    elements (the attention backends index pages and slots, never ``view`` the
    whole cache). Page ids come from :attr:`pool`. One more page, :attr:`scratch_page`
    (id ``num_pages``), is never handed out: padded rows of a captured decode step
    write their K/V there (``mm_serve.runtime.decode_graphs``). On Linux CPUs the
    storage is its own mapping on transparent huge pages (:mod:`mm_serve.runtime.huge_pages`).
    """

    def __init__(
        self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    ) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        shape = (num_pages + 1, num_layers, 2, page_size, num_kv_heads, head_dim)
        if torch.device(device).type == "cpu":  # 2 MiB pages for the scattered page reads
            self.data = huge_page_zeros(*shape, dtype=dtype)
        else:
            self.data = torch.zeros(*shape, dtype=dtype, device=device)
        self.scratch_page = num_pages
        self.pool = PagePool(num_pages)
        self.layer_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self.data[:, i, 0], self.data[:, i, 1]) for i in range(num_layers)
        ]

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token occupies across all layers (keys and values)."""
        _, layers, _, _, heads, dim = self.data.shape
        return layers * 2 * heads * dim * self.data.element_size()

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size
