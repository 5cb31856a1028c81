"""Where calls of the tier that is never refused wait for spare capacity before their dispatch.

The ``batch`` tier is never refused for latency, only queued (issue #20): under load a
batch request sent to a prefill worker at once would still take a share of it (a batch
of its prefill in progress delays tighter requests that arrive during it) and of the
decode worker (a larger decode batch is a longer step for every request on it, and on
a machine whose workers share cores, any work is time taken from the others). So such a
call waits here, in arrival order, until the admission controller says that dispatching
it now hurts no tighter request (:meth:`AdmissionController.hold_reason`), or until it has
waited its longest hold. One poller task per event loop checks the head of the line every
``poll_s`` seconds and lets one go at a time (it is dispatched before the next check, so
each check sees the calls let go before it); a call that is cancelled while it waits (its client went away) leaves
the line.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

POLL_S = 0.01  # how often the head of the line is checked, seconds


@dataclass
class _Waiter:
    ready: Callable[[], bool]
    requests: int
    tokens: int
    until: float  # monotonic seconds: dispatched then, ready or not
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class DispatchHold:
    """A FIFO line of calls waiting for their dispatch, and the task that lets them go.

    Raises (constructor):
        ValueError: ``poll_s <= 0``.
    """

    def __init__(self, poll_s: float = POLL_S, clock: Callable[[], float] = time.monotonic) -> None:
        if not poll_s > 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        self.poll_s = poll_s
        self._clock = clock
        self._line: deque[_Waiter] = deque()
        self._poller: asyncio.Task[None] | None = None
        self.num_held = 0  # calls that had to wait (since start)
        self.num_released_by_time = 0  # of those, let go because they waited their longest hold

    def queued(self) -> tuple[int, int]:
        """(engine requests, prompt tokens) of the calls waiting in the line now."""
        return sum(w.requests for w in self._line), sum(w.tokens for w in self._line)

    async def wait(self, ready: Callable[[], bool], requests: int, tokens: int, longest_s: float) -> float:
        """Return at once when the line is empty and ``ready()`` is true; otherwise join the line
        and return when this call reaches its head with ``ready()`` true, or after ``longest_s``
        seconds, whichever is first. ``requests`` and ``tokens`` (its engine requests and their
        prompt tokens) count in :meth:`queued` while it waits. Returns the seconds it waited.

        Raises:
            asyncio.CancelledError: the awaiting task was cancelled (the call leaves the line).
        """
        if not self._line and ready():
            return 0.0
        begun = self._clock()
        waiter = _Waiter(ready, requests, tokens, begun + max(0.0, longest_s))
        self._line.append(waiter)
        self.num_held += 1
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        try:
            await waiter.future
        finally:
            if waiter in self._line:  # cancelled while waiting
                self._line.remove(waiter)
        return self._clock() - begun

    async def _poll(self) -> None:
        while self._line:
            now = self._clock()
            for waiter in [w for w in self._line if w.until <= now or w.future.done()]:
                self._line.remove(waiter)
                if not waiter.future.done():
                    self.num_released_by_time += 1
                    waiter.future.set_result(None)
            if self._line and self._line[0].ready():
                self._line.popleft().future.set_result(None)
                await asyncio.sleep(0)  # its task dispatches it now: the next check sees it
                continue
            await asyncio.sleep(self.poll_s)
