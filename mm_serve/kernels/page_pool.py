"""Page (block) pool of the paged KV cache: ids, reference counts, a free list and the prefix-cache map.

This module deliberately imports no torch: it manages integers (and page hashes as
bytes) only, so it can run (and be tested) anywhere, including in the scheduler of a
process that holds no tensors. The tensor storage behind the ids is
:class:`mm_serve.runtime.kv_cache.PagedKVCache`.

Prefix caching (vLLM's automatic prefix caching, Kwon et al. SOSP 2023 and
``v1/core/block_pool.py``; SGLang's RadixAttention, Zheng et al. 2024): a full page whose
KV has been computed may be *registered* under its content hash
(:mod:`mm_serve.runtime.page_hashes`). When its last user frees it, it goes to the free
list like any page but keeps its hash, so a later request with the same hash chain can
*share* it again instead of recomputing it. It is *evicted* (its hash forgotten) only when
:meth:`PagePool.allocate` takes it from the head of the free list for new content: the
free list is the LRU order of eviction. Pages in use (ref count >= 1) are never evicted.

Design follows the block managers of vLLM and nano-vllm (``engine/block_manager.py``),
written anew here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PagePoolExhaustedError(RuntimeError):
    """Raised when more pages are requested than are free; nothing is allocated."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"KV page pool exhausted: requested {requested} pages, {free} free")
        self.requested = requested
        self.free = free


class PagePool:
    """A fixed set of ``num_pages`` KV pages with reference counts and a hash -> page map.

    Invariants (checked by :meth:`check_integrity`):

    * every page id in ``[0, num_pages)`` is either free (ref count 0, present
      exactly once in the free list) or in use (ref count >= 1, absent from it);
    * the free list is in release order: :meth:`allocate` takes pages from its
      head (the page freed longest ago, i.e. least recently used), :meth:`free`
      appends to its tail, :meth:`share` takes a cached free page out of it
      wherever it is. A fresh pool hands out ``0, 1, 2, ...`` in order;
    * the prefix-cache map is one to one: a hash names at most one page and a page
      carries at most one hash; a page with a hash is in use or free, never both,
      and :meth:`allocate` drops the hash of every page it hands out (eviction).

    Mutations: :meth:`allocate`, :meth:`incref`, :meth:`share`, :meth:`free`,
    :meth:`register`, :meth:`clear_cache`. Nothing else changes state.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._ref_counts = [0] * num_pages
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self._page_of: dict[bytes, int] = {}  # page hash -> page id
        self._hash_of: dict[int, bytes] = {}  # page id -> page hash
        self.num_evictions = 0  # cached pages whose hash was dropped to reuse the page

    @property
    def num_free(self) -> int:
        """Pages with ref count 0 (cached free pages included: they are reusable)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages with ref count >= 1."""
        return self.num_pages - len(self._free)

    @property
    def num_cached(self) -> int:
        """Pages that carry a prefix-cache hash (in use or free)."""
        return len(self._page_of)

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
        """Take ``n`` pages from the head of the free list, each with ref count 1; a cached
        page taken this way loses its hash (it is evicted).

        Raises:
            PagePoolExhaustedError: fewer than ``n`` pages are free (nothing changes).
            ValueError: ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise PagePoolExhaustedError(n, len(self._free))
        pages = [self._free.popitem(last=False)[0] for _ in range(n)]
        for page in pages:
            self._ref_counts[page] = 1
            digest = self._hash_of.pop(page, None)
            if digest is not None:
                del self._page_of[digest]
                self.num_evictions += 1
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
        """Drop one reference from each page; a page reaching 0 goes to the free-list tail
        (keeping its hash, if it has one: it stays reusable until evicted).

        Raises:
            ValueError: a page id is out of range or already free (double free).
        """
        for page in page_ids:
            self._check_in_use(page)
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                self._free[page] = None

    # ---- prefix cache ------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The pages of the longest run of ``hashes``, from the first, that are cached.

        Read-only: take them with :meth:`share`.
        """
        pages: list[int] = []
        for digest in hashes:
            page = self._page_of.get(digest)
            if page is None:
                break
            pages.append(page)
        return pages

    def share(self, page_ids: Iterable[int]) -> None:
        """Add one reference to each cached page, taking a free one out of the free list.

        Raises:
            ValueError: a page id is out of range or carries no hash.
        """
        for page in page_ids:
            if not 0 <= page < self.num_pages:
                raise ValueError(f"page id {page} out of range [0, {self.num_pages})")
            if page not in self._hash_of:
                raise ValueError(f"page {page} is not a cached page")
            if self._ref_counts[page] == 0:
                del self._free[page]
            self._ref_counts[page] += 1

    def num_free_among(self, page_ids: Iterable[int]) -> int:
        """How many of ``page_ids`` are free now (sharing them takes them off the free list)."""
        return sum(1 for page in set(page_ids) if self._ref_counts[page] == 0)

    def register(self, page_id: int, digest: bytes) -> bool:
        """Record that in-use page ``page_id`` holds the full page whose hash is ``digest``.

        Returns False (and changes nothing) when ``digest`` already names a page (the same
        content computed twice, e.g. by two requests of one batch) or the page already
        carries a hash.

        Raises:
            ValueError: the page id is out of range or free.
        """
        self._check_in_use(page_id)
        if digest in self._page_of or page_id in self._hash_of:
            return False
        self._page_of[digest] = page_id
        self._hash_of[page_id] = digest
        return True

    def hash_of(self, page_id: int) -> bytes | None:
        """The hash ``page_id`` is cached under, or None."""
        return self._hash_of.get(page_id)

    def clear_cache(self) -> int:
        """Forget every hash (pages in use stay in use); returns how many were dropped."""
        dropped = len(self._page_of)
        self._page_of.clear()
        self._hash_of.clear()
        return dropped

    # ---- checks ------------------------------------------------------------------------------

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
        for page in self._free:
            if not 0 <= page < self.num_pages:
                raise AssertionError(f"free list holds page {page}, out of range")
            if self._ref_counts[page] != 0:
                raise AssertionError(f"free page {page} has ref count {self._ref_counts[page]}")
        for page, count in enumerate(self._ref_counts):
            if count < 0:
                raise AssertionError(f"page {page} has negative ref count {count}")
            if count == 0 and page not in self._free:
                raise AssertionError(f"page {page} has ref count 0 but is not in the free list")
        if len(self._page_of) != len(self._hash_of):
            raise AssertionError(f"{len(self._page_of)} hashes name {len(self._hash_of)} pages")
        for digest, page in self._page_of.items():
            if self._hash_of.get(page) != digest:
                raise AssertionError(f"hash {digest.hex()[:16]} names page {page}, which carries another")
