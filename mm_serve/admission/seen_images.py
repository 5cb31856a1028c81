"""Which image URLs the API process has seen lately: the ones that may be in a worker's cache.

The early admission check (:meth:`AdmissionController.precheck`) runs before a call's
images are fetched or decoded. An image this process has never been sent cannot be in
any prefill worker's prefix or encoder cache (those are filled only by requests that came
through here), so its tokens are certain work and can count in that check; an image seen
before may be cached and counts as nothing there. The check is by the URL's exact text
(a data URI's bytes), so the same picture sent in another encoding or at another URL
counts as unseen: the check then counts work a cache might have spared, which is the
one way this can refuse a call that the full check after decoding would have admitted.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable

DEFAULT_CAPACITY = 4096  # digests remembered (16 bytes each)


class SeenImages:
    """A bounded LRU set of image-URL digests (BLAKE2b, 16 bytes).

    Raises (constructor):
        ValueError: ``capacity < 1``.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._digests: OrderedDict[bytes, None] = OrderedDict()

    def count_unseen(self, urls: Iterable[str]) -> int:
        """How many of ``urls`` were not seen before; all of them are remembered from now on
        (a URL repeated within ``urls`` counts once)."""
        return sum(self.unseen_flags(urls))

    def unseen_flags(self, urls: Iterable[str]) -> list[bool]:
        """For each of ``urls``, in order, whether it was not seen before (a repeat within
        ``urls`` is seen); all of them are remembered from now on."""
        flags = []
        for url in urls:
            digest = hashlib.blake2b(url.encode("utf-8", "surrogatepass"), digest_size=16).digest()
            flags.append(digest not in self._digests)
            if not flags[-1]:
                self._digests.move_to_end(digest)
                continue
            self._digests[digest] = None
            if len(self._digests) > self.capacity:
                self._digests.popitem(last=False)
        return flags
