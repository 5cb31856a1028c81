"""How long a call's media work still has to run, from the media work in flight in the API process.

The API process fetches, decodes and preprocesses images (and tokenizes prompts) on a few
threads that share the cores with the workers; under a burst, the calls in that phase finish
in roughly the order they started, at the rate the process gets through them. So the time a
call still has to wait is about the number of calls in the phase that started before it, plus
itself, over the rate at which calls have been leaving the phase lately (Little's law read
per call; Little 1961). Without a measured rate (fewer than two calls left the phase within
:data:`RATE_WINDOW_S`) the estimate is the time the call has already spent there: what has run
this long may well run as long again.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque

RATE_WINDOW_S = 1.0  # seconds of completions the rate is read over


class MediaLoad:
    """The calls in their media phase (by ticket, in the order they entered) and the recent
    completions. Thread-safe; times are ``time.monotonic()`` seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tickets = itertools.count()
        self._running: dict[int, float] = {}  # ticket -> when it entered (insertion order = ticket order)
        self._left: deque[float] = deque()  # when calls left the phase, the last RATE_WINDOW_S

    def enter(self, now: float | None = None) -> int:
        """A call starts its media work; returns its ticket."""
        with self._lock:
            ticket = next(self._tickets)
            self._running[ticket] = time.monotonic() if now is None else now
            return ticket

    def leave(self, ticket: int, now: float | None = None) -> None:
        """The call of ``ticket`` is done with its media work (finished, failed or cancelled)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._running.pop(ticket, None) is not None:
                self._left.append(now)
            self._trim(now)

    def in_flight(self) -> int:
        """Calls in their media phase now."""
        with self._lock:
            return len(self._running)

    def expected_remaining(self, ticket: int, now: float | None = None) -> float:
        """Seconds the call of ``ticket`` is expected to spend in its media phase from ``now``:
        (calls that entered before it and are still running + 1) / the completion rate over the
        last :data:`RATE_WINDOW_S`, or, without two completions there, the time it has spent so
        far; 0.0 for a ticket that is not running."""
        now = time.monotonic() if now is None else now
        with self._lock:
            entered = self._running.get(ticket)
            if entered is None:
                return 0.0
            self._trim(now)
            spent = max(0.0, now - entered)
            if len(self._left) < 2:
                return spent
            span = max(now - self._left[0], 1e-3)
            rate = len(self._left) / span  # calls per second
            ahead = sum(1 for t in self._running if t < ticket)
            return (ahead + 1) / rate

    def _trim(self, now: float) -> None:
        while self._left and now - self._left[0] > RATE_WINDOW_S:
            self._left.popleft()
