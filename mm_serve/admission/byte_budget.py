"""A thread-safe budget of bytes held by images being fetched, decoded and preprocessed.

The API reserves, before it fetches a call's images, each image's encoded size (the
data URI's length, or ``api.max_image_fetch_bytes`` for a URL it must fetch) plus
``admission.image_decode_reserve_bytes`` for its decoded and preprocessed copies, and
releases them when the call's inputs are built. A call that does not fit waits for the bytes
(first come, first served: :meth:`ByteBudget.reserve_waiting`) up to ``admission.image_wait_s``,
then is refused with 429 ``image_bytes`` and ``Retry-After``, so a burst of large images cannot grow
host memory unbounded and a burst that fits in time is queued, not refused. A video reserves its
encoded size and its demuxing first, then, once its packets say how many frames of what size it
will decode, those (:meth:`Hold.grow`).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

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
            Rejection: 429 ``image_bytes`` when they do not fit (``what`` names them).
        """
        nbytes = min(max(0, nbytes), self.budget.capacity - self.nbytes)
        if nbytes and not self.budget.try_reserve(nbytes):
            raise self.budget.refusal(nbytes, what)
        self.nbytes += nbytes


@dataclass
class _Waiter:
    """A call waiting for ``nbytes`` (on ``loop``); ``granted`` once they were reserved for it."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    nbytes: int
    granted: bool = False


class ByteBudget:
    """At most ``capacity`` bytes reserved at once; callers on an event loop may wait for room, first
    come first served."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 byte, got {capacity}")
        self.capacity = capacity
        self.reserved = 0
        self._lock = threading.Lock()
        self._waiters: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        """Calls waiting for room now."""
        return len(self._waiters)

    def try_reserve(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` if they fit now (ahead of any waiter: a call already running grows); returns
        whether they were reserved."""
        with self._lock:
            if self.reserved + nbytes > self.capacity:
                return False
            self.reserved += nbytes
            return True

    async def reserve_waiting(self, nbytes: int, wait_s: float) -> bool:
        """Reserve ``nbytes`` (at most the capacity: the caller caps them), waiting behind the calls that
        came first for up to ``wait_s`` seconds; returns whether they were reserved. Cancelled while
        waiting, it reserves nothing (what was granted meanwhile goes back)."""
        nbytes = min(max(0, nbytes), self.capacity)
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self._waiters and self.reserved + nbytes <= self.capacity:
                self.reserved += nbytes
                return True
            waiter = _Waiter(loop, loop.create_future(), nbytes)
            self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), wait_s)
        except asyncio.TimeoutError:
            pass
        except asyncio.CancelledError:
            if self._withdraw(waiter):
                self.release(nbytes)
            raise
        return self._withdraw(waiter)

    def _withdraw(self, waiter: _Waiter) -> bool:
        """Take ``waiter`` out of the queue; returns whether its bytes had been granted (then they are
        reserved for it)."""
        with self._lock:
            if waiter.granted:
                return True
            self._waiters.remove(waiter)
            self._grant()  # the head left: those behind it may fit
            return False

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.reserved = max(0, self.reserved - nbytes)
            self._grant()

    def _grant(self) -> None:
        """Reserve for the waiters at the head of the queue while they fit (under the lock)."""
        while self._waiters and self.reserved + self._waiters[0].nbytes <= self.capacity:
            waiter = self._waiters.popleft()
            self.reserved += waiter.nbytes
            waiter.granted = True
            waiter.loop.call_soon_threadsafe(_wake, waiter.future)

    def refusal(self, nbytes: int, what: str) -> Rejection:
        """The 429 ``image_bytes`` for ``what`` needing ``nbytes`` that did not fit in time."""
        return Rejection(
            429, "image_bytes",
            f"too many images or videos are being decoded at once: {what} need {nbytes} bytes and "
            f"{self.reserved} of {self.capacity} (admission.max_image_bytes_in_flight) are in use; retry shortly",
            IMAGE_RETRY_AFTER_S,
        )

    @asynccontextmanager
    async def hold(self, nbytes: int, what: str, wait_s: float) -> AsyncIterator[Hold]:
        """Reserve ``nbytes``, waiting up to ``wait_s`` seconds for room, for the ``async with`` body (which
        may :meth:`Hold.grow` them), then release all it holds. More than the whole ``capacity`` reserves
        all of it: such a call runs alone rather than never.

        Raises:
            Rejection: 429 ``image_bytes`` when they did not fit within ``wait_s`` (``what`` names them).
        """
        nbytes = min(max(0, nbytes), self.capacity)
        if nbytes and not await self.reserve_waiting(nbytes, wait_s):
            raise self.refusal(nbytes, what)
        held = Hold(self, nbytes)
        try:
            yield held
        finally:
            self.release(held.nbytes)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
