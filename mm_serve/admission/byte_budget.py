"""A thread-safe budget of bytes held by images being fetched, decoded and preprocessed.

The API reserves, before it fetches a call's images, each image's encoded size (the
data URI's length, or ``api.max_image_fetch_bytes`` for a URL it must fetch) plus
``admission.image_decode_reserve_bytes`` for its decoded and preprocessed copies, and
releases them when the call's inputs are built. A call that does not fit is refused at
once (never queued), so a burst of large images cannot grow host memory unbounded. A video
reserves its encoded size and its demuxing first, then, once its packets say how many frames
of what size it will decode, those (:meth:`Hold.grow`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from mm_serve.admission.rejection import Rejection

IMAGE_RETRY_AFTER_S = 1.0


class Hold:
    """Bytes one call holds in a :class:`ByteBudget`, released together when its ``with`` ends."""

    def __init__(self, budget: ByteBudget, nbytes: int) -> None:
        self.budget = budget
        self.nbytes = nbytes

    def grow(self, nbytes: int, what: str) -> None:
        """Hold ``nbytes`` more (thread-safe: a media thread calls it); at most what is left of the whole capacity
        beyond what this call holds.

        Raises:
            Rejection: 503 ``image_bytes`` when they do not fit (``what`` names them).
        """
        nbytes = min(max(0, nbytes), self.budget.capacity - self.nbytes)
        if nbytes and not self.budget.try_reserve(nbytes):
            raise self.budget.refusal(nbytes, what)
        self.nbytes += nbytes


class ByteBudget:
    """At most ``capacity`` bytes reserved at once."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 byte, got {capacity}")
        self.capacity = capacity
        self.reserved = 0
        self._lock = threading.Lock()

    def try_reserve(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` if they fit; returns whether they were reserved."""
        with self._lock:
            if self.reserved + nbytes > self.capacity:
                return False
            self.reserved += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.reserved = max(0, self.reserved - nbytes)

    def refusal(self, nbytes: int, what: str) -> Rejection:
        """The 503 ``image_bytes`` for ``what`` needing ``nbytes`` that do not fit now."""
        return Rejection(
            503, "image_bytes",
            f"too many images or videos are being decoded at once: {what} need {nbytes} bytes and "
            f"{self.reserved} of {self.capacity} (admission.max_image_bytes_in_flight) are in use; retry shortly",
            IMAGE_RETRY_AFTER_S,
        )

    @contextmanager
    def hold(self, nbytes: int, what: str) -> Iterator[Hold]:
        """Reserve ``nbytes`` for the ``with`` body (which may :meth:`Hold.grow` them), then release all it
        holds. More than the whole ``capacity`` reserves all of it: such a call runs alone rather than never.

        Raises:
            Rejection: 503 ``image_bytes`` when they do not fit (``what`` names them).
        """
        nbytes = min(max(0, nbytes), self.capacity)
        if nbytes and not self.try_reserve(nbytes):
            raise self.refusal(nbytes, what)
        held = Hold(self, nbytes)
        try:
            yield held
        finally:
            self.release(held.nbytes)
