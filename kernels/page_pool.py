"""Page (block) pool of the paged KV cache: ids, reference counts and a free list.

This module deliberately imports no torch: it manages integers only, so it can
run (and be tested) anywhere, including in the scheduler of a process that
holds no tensors. The tensor storage behind the ids is
:class:`mm_serve.runtime.kv_cache.PagedKVCache`.

Design follows the block managers of vLLM (``v1/core/block_pool.py``) and
nano-vllm (``engine/block_manager.py``), written anew here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class PagePoolExhaustedError(RuntimeError):
    """Raised when more pages are requested than are free; nothing is allocated."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"KV page pool exhausted: requested {requested} pages, {free} free")
        self.requested = requested
        self.free = free


class PagePool:
    """A fixed set of ``num_pages`` KV pages with reference counts.

    Invariants (checked by :meth:`check_integrity`):

    * every page id in ``[0, num_pages)`` is either free (ref count 0, present
      exactly once in the free list) or in use (ref count >= 1, absent from it);
    * the free list is in release order: :meth:`allocate` takes pages from its
      head (the page freed longest ago, i.e. least recently used), :meth:`free`
      appends to its tail. A fresh pool hands out ``0, 1, 2, ...`` in order.

    Mutations: :meth:`allocate`, :meth:`incref`, :meth:`free`. Nothing else
    changes state.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._ref_counts = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        """Pages with ref count 0."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages with ref count >= 1."""
        return self.num_pages - len(self._free)

    def ref_count(self, page_id: int) -> int:
        """Current reference count of ``page_id``."""
        return self._ref_counts[page_id]

    def free_page_ids(self) -> list[int]:
        """The free list, head (next to be allocated) first."""
        return list(self._free)

    def can_allocate(self, n: int) -> bool:
        """Whether ``n`` pages can be allocated now."""
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages from the head of the free list, each with ref count 1.

        Raises:
            PagePoolExhaustedError: fewer than ``n`` pages are free (nothing changes).
            ValueError: ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise PagePoolExhaustedError(n, len(self._free))
        pages = [self._free.popleft() for _ in range(n)]
        for page in pages:
            self._ref_counts[page] = 1
        return pages

    def incref(self, page_ids: Iterable[int]) -> None:
        """Add one reference to each page (sharing); each must be in use.

        Raises:
            ValueError: a page id is out of range or free.
        """
        for page in page_ids:
            self._check_in_use(page)
            self._ref_counts[page] += 1

    def free(self, page_ids: Iterable[int]) -> None:
        """Drop one reference from each page; a page reaching 0 goes to the free-list tail.

        Raises:
            ValueError: a page id is out of range or already free (double free).
        """
        for page in page_ids:
            self._check_in_use(page)
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                self._free.append(page)

    def _check_in_use(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page id {page} out of range [0, {self.num_pages})")
        if self._ref_counts[page] == 0:
            raise ValueError(f"page {page} is free (double free or use after free)")

    def integrity_ok(self) -> bool:
        """:meth:`check_integrity` as a boolean, for health reports."""
        try:
            self.check_integrity()
        except AssertionError:
            return False
        return True

    def check_integrity(self) -> None:
        """Verify the invariants in the class docstring.

        Raises:
            AssertionError: an invariant is broken (a bug in the caller or here).
        """
        seen: set[int] = set()
        for page in self._free:
            if page in seen:
                raise AssertionError(f"page {page} is in the free list twice")
            if self._ref_counts[page] != 0:
                raise AssertionError(f"free page {page} has ref count {self._ref_counts[page]}")
            seen.add(page)
        for page, count in enumerate(self._ref_counts):
            if count < 0:
                raise AssertionError(f"page {page} has negative ref count {count}")
            if count == 0 and page not in seen:
                raise AssertionError(f"page {page} has ref count 0 but is not in the free list")
