"""The router's picture of what each prefill worker holds in its prefix cache.

The front end cannot see the workers' page pools, so, like SGLang's ``cache_aware``
router (its approximate radix tree per worker), it remembers which page hashes
(:mod:`mm_serve.runtime.page_hashes`) it sent to which worker: a worker that prefilled a
request caches those pages until its pool needs them for other content. Each worker's
record is an LRU set bounded by that worker's page count, so it forgets roughly when the
worker evicts. It is a routing hint only: a wrong guess costs a recompute, never a wrong
output (the worker matches hashes against its own pool).

The same record, keyed by image content hash and bounded by the images an encoder cache
holds, stands for each prefill worker's encoder cache (:meth:`PrefixIndex.held`): an image
sent there lately is not encoded again, so the latency predictor does not price it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    """Page hashes recently sent to each of ``num_workers`` workers, at most ``capacity`` each."""

    def __init__(self, num_workers: int, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 page, got {capacity}")
        self.capacity = capacity
        self._held: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_workers)]

    def match(self, worker: int, hashes: Sequence[bytes]) -> int:
        """How many pages from the start of ``hashes`` worker ``worker`` is believed to hold."""
        held = self._held[worker]
        count = 0
        for digest in hashes:
            if digest not in held:
                break
            count += 1
        return count

    def held(self, worker: int, hashes: Sequence[bytes]) -> list[bool]:
        """For each of ``hashes``, in order and in any position, whether worker ``worker`` is
        believed to hold it."""
        held = self._held[worker]
        return [digest in held for digest in hashes]

    def record(self, worker: int, hashes: Sequence[bytes]) -> None:
        """Worker ``worker`` was sent a request with these full-page hashes (now most recent)."""
        held = self._held[worker]
        for digest in hashes:
            held[digest] = None
            held.move_to_end(digest)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def forget(self, worker: int) -> None:
        """Worker ``worker`` restarted: its cache is empty."""
        self._held[worker].clear()

    def size(self, worker: int) -> int:
        return len(self._held[worker])
