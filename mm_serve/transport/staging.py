"""The producer side's room in a ring: KV pages from a page pool, feature rows from an arena.

Every transport stages a hand-off the same way before it publishes it: the prefill worker
takes ``n`` pages and one contiguous extent of feature rows, writes the request's KV and
features there, and publishes. The pages and the extent stay taken until the consumer
releases the hand-off (then the ring gives them back here) or the producer gives up on an
unpublished hand-off (:meth:`StagingArea.free_unpublished`). A full pool or arena is the
ring's backpressure: the allocation returns None and the producer retries later.

The shared-memory ring stages in the shared segments themselves (the consumer reads the
same memory); the Ray ring stages in local memory that :meth:`publish` copies into the
object store. Only integers are managed here; the memory belongs to the ring.
"""

from __future__ import annotations

from collections.abc import Callable

from mm_serve.kernels.page_pool import PagePool
from mm_serve.transport.feature_arena import FeatureArena
from mm_serve.transport.ring_spec import Handoff, RingSpec

Reclaim = Callable[[], int]
"""The ring's reclaim: takes back what the consumer released, returns how many hand-offs."""


class StagingArea:
    """Pages ``[0, spec.num_pages)`` and feature rows ``[0, spec.feature_rows)`` of one ring's
    producer, with the allocations not yet published tracked apart from the published ones.

    Invariants (checked by :meth:`check_integrity` and the publish-time checks): a page or an
    extent is free, unpublished (allocated, not published, owned by the producer) or
    published (owned by the hand-off until it is released and freed); each page id of an
    unpublished or published hand-off is in no other hand-off.
    """

    def __init__(self, spec: RingSpec) -> None:
        self.spec = spec
        self._pool = PagePool(spec.num_pages)
        self._arena = FeatureArena(spec.feature_rows)
        self._unpublished_pages: set[int] = set()
        self._unpublished_features: set[tuple[int, int]] = set()

    @property
    def pages_free(self) -> int:
        """Pages neither unpublished nor held by a published, unreleased hand-off."""
        return self._pool.num_free

    @property
    def feature_rows_free(self) -> int:
        """Feature rows in no extent."""
        return self._arena.num_free

    def alloc_pages(self, n: int, reclaim: Reclaim) -> list[int] | None:
        """``n`` free page ids (calling ``reclaim`` first when fewer are free), or None.

        Raises:
            ValueError: ``n`` is outside ``[0, spec.max_pages_per_handoff]``.
        """
        if not 0 <= n <= self.spec.max_pages_per_handoff:
            raise ValueError(f"cannot hand off {n} pages (max {self.spec.max_pages_per_handoff})")
        if not self._pool.can_allocate(n) and not (reclaim() and self._pool.can_allocate(n)):
            return None
        page_ids = self._pool.allocate(n)
        self._unpublished_pages.update(page_ids)
        return page_ids

    def alloc_features(self, rows: int, reclaim: Reclaim) -> int | None:
        """Offset of ``rows`` contiguous free rows (0 for 0 rows; calling ``reclaim`` when no
        extent fits), or None.

        Raises:
            ValueError: ``rows`` is negative or larger than the arena.
        """
        if rows == 0:
            return 0
        offset = self._arena.allocate(rows)
        if offset is None and reclaim():
            offset = self._arena.allocate(rows)
        if offset is not None:
            self._unpublished_features.add((offset, rows))
        return offset

    def check_unpublished(self, page_ids: list[int], feature_offset: int, feature_rows: int) -> None:
        """Check that the pages and the extent are allocated here and not published.

        Raises:
            ValueError: a page repeats or is not unpublished, or the extent (when
                ``feature_rows`` > 0) is not an unpublished allocation.
        """
        if len(set(page_ids)) != len(page_ids) or not self._unpublished_pages.issuperset(page_ids):
            raise ValueError(f"pages {page_ids} are not all allocated and unpublished")
        extent = (feature_offset, feature_rows)
        if feature_rows and extent not in self._unpublished_features:
            raise ValueError(f"feature extent {extent} is not allocated and unpublished")

    def free_unpublished(self, page_ids: list[int], feature_offset: int, feature_rows: int) -> None:
        """Give back the allocations of a hand-off that will not be published.

        Raises:
            ValueError: as :meth:`check_unpublished` (nothing is freed then).
        """
        self.check_unpublished(page_ids, feature_offset, feature_rows)
        self._unpublished_pages.difference_update(page_ids)
        self._pool.free(page_ids)
        if feature_rows:
            self._unpublished_features.discard((feature_offset, feature_rows))
            self._arena.free(feature_offset, feature_rows)

    def mark_published(self, handoff: Handoff) -> None:
        """``handoff``'s pages and extent now belong to the published hand-off (call after
        :meth:`check_unpublished` passed and the hand-off was published)."""
        self._unpublished_pages.difference_update(handoff.page_ids)
        self._unpublished_features.discard((handoff.feature_offset, handoff.feature_rows))

    def free_released(self, handoff: Handoff) -> None:
        """Free the pages and extent of a published hand-off the consumer released."""
        self._pool.free(handoff.page_ids)
        if handoff.feature_rows:
            self._arena.free(handoff.feature_offset, handoff.feature_rows)

    def check_integrity(self) -> None:
        """Check the page pool and the arena; AssertionError if an invariant is broken."""
        self._pool.check_integrity()
        self._arena.check_integrity()
