"""A thread-safe budget of bytes held by images being fetched, decoded and preprocessed.

The API reserves, before it fetches a call's images, each image's encoded size (the
data URI's length, or ``api.max_image_fetch_bytes`` for a URL it must fetch) plus
``admission.image_decode_reserve_bytes`` for its decoded and preprocessed copies, and
releases them when the call's inputs are built. A call that does not fit is refused at
once (never queued), so a burst of large images cannot grow host memory unbounded.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from mm_serve.admission.rejection import Rejection

IMAGE_RETRY_AFTER_S = 1.0


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

    @contextmanager
    def hold(self, nbytes: int, what: str) -> Iterator[None]:
        """Reserve ``nbytes`` for the ``with`` body, then release them. More than the whole
        ``capacity`` reserves all of it: such a call runs alone rather than never.

        Raises:
            Rejection: 503 ``image_bytes`` when they do not fit (``what`` names them).
        """
        if nbytes <= 0:
            yield
            return
        nbytes = min(nbytes, self.capacity)
        if not self.try_reserve(nbytes):
            raise Rejection(
                503, "image_bytes",
                f"too many images are being decoded at once: {what} need {nbytes} bytes and "
                f"{self.reserved} of {self.capacity} (admission.max_image_bytes_in_flight) are in use; retry shortly",
                IMAGE_RETRY_AFTER_S,
            )
        try:
            yield
        finally:
            self.release(nbytes)
