"""How long a call's media work still has to run, from the media work in flight in the API process.

The API process fetches, decodes and preprocesses images (and tokenizes prompts) on a few
threads that share the cores with the workers; under a burst the calls in that phase finish in
roughly the order they started, at the rate the process gets through their work. Each call
brings a *work* figure: the megapixels of its images (declared in their headers, or
:data:`~mm_serve.pipeline.gate.UNDECLARED_IMAGE_MEGAPIXELS` each) plus a small fixed part
for templating and tokenizing. The time a call still has to wait is then the work of the calls
in the phase that started before it, plus its own, over the work throughput (Little's law over
work; Little 1961):

* measured over the last :data:`RATE_WINDOW_S`: the work of the calls that left the phase there,
  over the time the phase was busy with them (the union of their stays, from entering to leaving),
  with at least two of them. Busy time, not wall time: calls that come one at a time with pauses
  between them leave at the rate they arrive (1.6 MP/s measured for small images a second apart, which
  prices a 30 MP image at 19 s; it takes 0.4 s);
* else the throughput last measured that way (a burst after a quiet spell);
* else (nothing measured yet since start) a lower bound from the oldest call in the phase: it has
  run for its whole time so far without finishing its work, on at most ``os.cpu_count()`` cores
  shared with everyone else in the phase.

Never less than the time the call has already spent there.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque

RATE_WINDOW_S = 1.0  # seconds of completions the throughput is read over


class MediaLoad:
    """The calls in their media phase (by ticket, in the order they entered, with their work)
    and the recent completions. Thread-safe; times are ``time.monotonic()`` seconds, work in
    megapixel equivalents."""

    def __init__(self, cores: int | None = None) -> None:
        self._lock = threading.Lock()
        self._tickets = itertools.count()
        self._running: dict[int, tuple[float, float]] = {}  # ticket -> (entered at, work); in ticket order
        self._left: deque[tuple[float, float, float]] = deque()  # (left at, entered at, work), last RATE_WINDOW_S
        self._throughput: float | None = None  # work per second, last measured
        self._cores = max(1, cores or os.cpu_count() or 1)

    def enter(self, work: float = 1.0, now: float | None = None) -> int:
        """A call of ``work`` (> 0) starts its media work; returns its ticket.

        Raises:
            ValueError: ``work`` is not positive.
        """
        if not work > 0:
            raise ValueError(f"media work must be positive, got {work}")
        with self._lock:
            ticket = next(self._tickets)
            self._running[ticket] = (time.monotonic() if now is None else now, work)
            return ticket

    def leave(self, ticket: int, now: float | None = None) -> None:
        """The call of ``ticket`` is done with its media work (finished, failed or cancelled)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            entry = self._running.pop(ticket, None)
            if entry is not None:
                self._left.append((now, entry[0], entry[1]))
            self._trim(now)
            measured = self._measured(now)
            if measured is not None:
                self._throughput = measured

    def in_flight(self) -> int:
        """Calls in their media phase now."""
        with self._lock:
            return len(self._running)

    def expected_remaining(self, ticket: int, now: float | None = None) -> float:
        """Seconds the call of ``ticket`` is expected to spend in its media phase from ``now`` (see
        the module's text); 0.0 for a ticket that is not running."""
        now = time.monotonic() if now is None else now
        with self._lock:
            entry = self._running.get(ticket)
            if entry is None:
                return 0.0
            self._trim(now)
            spent = max(0.0, now - entry[0])
            ahead = sum(work for t, (_, work) in self._running.items() if t <= ticket)
            throughput = self._measured(now) or self._throughput
            if throughput is None:  # the oldest call ran all this time on at most all the cores
                oldest_at, oldest_work = next(iter(self._running.values()))
                per_core = oldest_work / max(now - oldest_at, 1e-3)
                throughput = per_core * self._cores
            return max(spent, ahead / throughput)

    def _measured(self, now: float) -> float | None:
        if len(self._left) < 2:
            return None
        busy, end = 0.0, float("-inf")  # the union of the stays [entered, left], by when they began
        for entered, left in sorted((entered, left) for left, entered, _ in self._left):
            if left > end:
                busy += left - max(entered, end)
                end = left
        return sum(work for _, _, work in self._left) / max(busy, 1e-3)

    def _trim(self, now: float) -> None:
        while self._left and now - self._left[0][0] > RATE_WINDOW_S:
            self._left.popleft()
