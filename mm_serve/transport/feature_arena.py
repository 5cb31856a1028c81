"""First-fit allocator of contiguous row extents in the ring's feature arena.

The arena holds patch-embedding features ``[feature_rows, feature_dim]``; one
image's features (e.g. 576 rows for CLIP ViT-L/14-336) must be contiguous, so
unlike the KV page pool this allocator hands out extents, not single ids. It
manages integers only (no torch) and lives on the producer side of the ring.
"""

from __future__ import annotations

import bisect


class FeatureArena:
    """Extents ``[offset, offset + rows)`` of ``[0, num_rows)``, allocated first-fit.

    Invariants (checked by :meth:`check_integrity`):

    * the free extents are sorted by offset, non-empty, and never touch or
      overlap (adjacent free extents are merged on :meth:`free`);
    * every row is in exactly one free or one allocated extent.

    Mutations: :meth:`allocate` and :meth:`free`.
    """

    def __init__(self, num_rows: int) -> None:
        if num_rows < 0:
            raise ValueError(f"num_rows must be >= 0, got {num_rows}")
        self.num_rows = num_rows
        self._free: list[tuple[int, int]] = [(0, num_rows)] if num_rows else []
        self._allocated: dict[int, int] = {}  # offset -> rows

    @property
    def num_free(self) -> int:
        """Free rows in total (possibly fragmented)."""
        return sum(rows for _, rows in self._free)

    @property
    def largest_free(self) -> int:
        """Rows of the largest free extent: the biggest allocation that succeeds now."""
        return max((rows for _, rows in self._free), default=0)

    def free_extents(self) -> list[tuple[int, int]]:
        """Free ``(offset, rows)`` extents in offset order."""
        return list(self._free)

    def allocate(self, rows: int) -> int | None:
        """Offset of a new extent of ``rows`` rows from the lowest free extent that fits.

        Returns None when no free extent is large enough (backpressure; nothing changes).

        Raises:
            ValueError: ``rows`` < 1 or larger than the whole arena (could never fit).
        """
        if not 1 <= rows <= self.num_rows:
            raise ValueError(f"cannot allocate {rows} rows in an arena of {self.num_rows}")
        for i, (offset, size) in enumerate(self._free):
            if size >= rows:
                if size == rows:
                    del self._free[i]
                else:
                    self._free[i] = (offset + rows, size - rows)
                self._allocated[offset] = rows
                return offset
        return None

    def free(self, offset: int, rows: int) -> None:
        """Return the extent ``(offset, rows)`` exactly as :meth:`allocate` gave it.

        Raises:
            ValueError: no allocated extent starts at ``offset`` with ``rows`` rows
                (double free or a wrong extent); nothing changes.
        """
        if self._allocated.get(offset) != rows:
            raise ValueError(f"feature extent ({offset}, {rows}) is not allocated")
        del self._allocated[offset]
        i = bisect.bisect_left(self._free, (offset, rows))
        end = offset + rows
        if i < len(self._free) and self._free[i][0] == end:  # merge with the next extent
            end += self._free[i][1]
            del self._free[i]
        if i > 0 and sum(self._free[i - 1]) == offset:  # merge with the previous extent
            offset = self._free[i - 1][0]
            i -= 1
            del self._free[i]
        self._free.insert(i, (offset, end - offset))

    def check_integrity(self) -> None:
        """Verify the invariants in the class docstring.

        Raises:
            AssertionError: an invariant is broken (a bug in the caller or here).
        """
        extents = [(o, r, "free") for o, r in self._free]
        extents += [(o, r, "allocated") for o, r in self._allocated.items()]
        extents.sort()
        position = 0
        for offset, rows, kind in extents:
            if rows < 1 or offset != position:
                raise AssertionError(f"{kind} extent ({offset}, {rows}) breaks tiling at row {position}")
            position = offset + rows
        if position != self.num_rows:
            raise AssertionError(f"extents cover {position} rows, arena has {self.num_rows}")
        for (a, ra), (b, _) in zip(self._free, self._free[1:], strict=False):
            if a + ra >= b:
                raise AssertionError(f"free extents at {a} and {b} touch or are out of order")
