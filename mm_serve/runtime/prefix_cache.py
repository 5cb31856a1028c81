"""Prefix caching over one engine's page pool: reuse the KV of full pages whose hash chain matches.

At admission (:meth:`PrefixCache.allocate`) a request takes the longest run of cached pages
whose chained hashes (:mod:`mm_serve.runtime.page_hashes`) equal those of its own full
pages, shares them read-only (ref-counted, :meth:`mm_serve.kernels.page_pool.PagePool.share`) and
gets fresh pages for the rest; only the rest is prefilled
(``Request.num_cached_tokens`` tells the runner where to start). At least the last token
is always computed (its logits give the next token), so a hit stops one token short of a
prompt that fills whole pages. Once KV is computed, :meth:`PrefixCache.commit` registers
the request's full pages under their hashes; when the request ends they stay cached in
the free list until evicted (:class:`~mm_serve.kernels.page_pool.PagePool`: LRU). Freed sequences
go to the free list last page first, so the deepest pages of a prefix are evicted before
the pages they depend on.

With ``enabled`` False every method degrades to plain allocation: nothing is hashed,
matched or registered.
"""

from __future__ import annotations

from dataclasses import dataclass

from mm_serve.kernels.page_pool import PagePool, PagePoolExhaustedError
from mm_serve.runtime.kv_cache import pages_for
from mm_serve.runtime.page_hashes import image_spans, page_hash_chain, salted
from mm_serve.runtime.request import Request


@dataclass(frozen=True)
class PrefixKey:
    """What hashing a request's pages needs besides the request (its images and their token counts):
    the chain's salt (model and dtype) and the image token id, or the image and video ids (None: a text-only
    model)."""

    salt: bytes
    image_token_id: int | tuple[int, ...] | None = None


class PrefixCache:
    """Allocation with prefix reuse for one :class:`PagePool` of ``page_size``-token pages.

    Counters (tokens, since start): ``queried_tokens`` (prompt tokens of admitted requests),
    ``hit_tokens`` (of them, those whose KV was reused).
    """

    def __init__(self, pool: PagePool, page_size: int, key: PrefixKey, enabled: bool = True) -> None:
        self.pool = pool
        self.page_size = page_size
        self.key = key
        self.enabled = enabled
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / queried_tokens`` (0 before any request)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def hashes(self, request: Request) -> list[bytes]:
        """The hashes of ``request``'s full pages (prompt and outputs), extending
        ``request.page_hashes`` as its tokens grow."""
        tokens = request.all_token_ids
        if len(request.page_hashes) < len(tokens) // self.page_size:
            spans = image_spans(tokens, self.key.image_token_id, request.image_token_counts[: len(request.image_hashes)])
            request.page_hashes = page_hash_chain(
                tokens, self.page_size, salted(self.key.salt, request.cache_salt), request.image_hashes[: len(spans)],
                spans,
                start=request.page_hashes,
            )
        return request.page_hashes

    def match(self, request: Request) -> list[int]:
        """Cached pages ``request`` can reuse now: the longest cached run of its page hashes,
        leaving at least its last token to compute. Read-only."""
        if not self.enabled or request.wants_prompt_logprobs:  # every prompt position's logits are needed
            return []
        usable = (request.num_tokens - 1) // self.page_size
        return self.pool.lookup(self.hashes(request)[:usable])

    def pages_needed(self, request: Request) -> int:
        """Free-list pages :meth:`allocate` would take for ``request`` now: its fresh pages plus
        the matched cached pages that sit free (sharing takes them off the free list)."""
        total = pages_for(request.num_tokens, self.page_size)
        hits = self.match(request)
        return total - len(hits) + self.pool.num_free_among(hits)

    def can_allocate(self, request: Request) -> bool:
        return self.pool.can_allocate(self.pages_needed(request))

    def allocate(self, request: Request) -> None:
        """Give ``request`` a block table for all its tokens: matched cached pages first
        (shared), fresh ones after; sets ``num_cached_tokens`` and counts the hit.

        Raises:
            PagePoolExhaustedError: not enough free pages (nothing changes).
        """
        total = pages_for(request.num_tokens, self.page_size)
        hits = self.match(request)
        need = total - len(hits) + self.pool.num_free_among(hits)
        if not self.pool.can_allocate(need):
            raise PagePoolExhaustedError(need, self.pool.num_free)
        self.pool.share(hits)  # first: allocate must not evict them
        request.block_table = hits + self.pool.allocate(total - len(hits))
        request.num_cached_tokens = len(hits) * self.page_size
        if request.output_offset == 0 and not request.output_token_ids:  # a first prefill, not a recompute
            request.num_prompt_cached_tokens = request.num_cached_tokens
            self.queried_tokens += request.num_prompt_tokens
            self.hit_tokens += request.num_cached_tokens

    def commit(self, request: Request, num_kv_tokens: int) -> int:
        """Register the full pages among ``request``'s first ``num_kv_tokens`` tokens (those
        whose KV is in its pages); returns how many pages became newly cached."""
        if not self.enabled:
            return 0
        full = min(num_kv_tokens // self.page_size, len(request.block_table))
        hashes = self.hashes(request)
        return sum(self.pool.register(page, digest)
                   for page, digest in zip(request.block_table[:full], hashes[:full], strict=True)
                   if self.pool.hash_of(page) is None)

    def release(self, request: Request, num_kv_tokens: int = 0) -> None:
        """Free ``request``'s pages, last page first, and empty its block table; first register
        the full pages among its first ``num_kv_tokens`` tokens (pass 0 when its KV may not
        have been computed, e.g. after a failed step: such pages must never be shared).

        Raises:
            ValueError: a page of its block table is already free.
        """
        if self.enabled and request.block_table:
            if num_kv_tokens:
                self.commit(request, num_kv_tokens)
            self.pool.free(reversed(request.block_table))
        else:
            self.pool.free(request.block_table)
        request.block_table = []
