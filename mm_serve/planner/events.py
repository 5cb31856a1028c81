"""The discrete-event loop: a time-ordered heap of callbacks."""

from __future__ import annotations

import heapq
from collections.abc import Callable


class EventLoop:
    """Runs callbacks in time order; ties run in the order they were scheduled.

    ``now`` is the simulated clock (seconds). A callback may schedule more events at
    or after ``now``; :meth:`run` returns once the heap is empty.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def at(self, time: float, action: Callable[[], None]) -> None:
        """Run ``action`` at ``time`` (seconds; clamped to ``now``)."""
        self._seq += 1
        heapq.heappush(self._heap, (max(time, self.now), self._seq, action))

    def run(self) -> None:
        """Process events until none are left."""
        heap = self._heap
        while heap:
            self.now, _, action = heapq.heappop(heap)
            action()
