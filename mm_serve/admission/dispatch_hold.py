"""Where calls of the tier that is never refused wait for spare capacity before their dispatch.

The ``batch`` tier is never refused for latency, only queued: under load a
batch request sent to a prefill worker at once would still take a share of it (a batch
of its prefill in progress delays tighter requests that arrive during it) and of the
decode worker (a larger decode batch is a longer step for every request on it, and on
a machine whose workers share cores, any work is time taken from the others). So such a
call waits here, in arrival order, until the admission controller says that dispatching
it now hurts no tighter request (:meth:`AdmissionController.hold_reason`), or until it has
waited its longest hold (each waiter keeps its own time, whatever the poller does). One
poller task checks the head of the line every ``poll_s`` seconds and lets one go at a time
(it is dispatched before the next check, so each check sees the calls let go before it); a
check that raises lets the call go too (its own admission then answers it). A call whose
client went away (``gone``, asked every :data:`GONE_POLL_S`) or whose task is cancelled
leaves the line.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

POLL_S = 0.01  # how often the head of the line is checked, seconds
GONE_POLL_S = 0.25  # how often a waiting call asks whether its client is still there, seconds
RESUME_TIMEOUT_S = 1.0  # the longest the poller waits for a released call's task to take its turn


@dataclass
class _Waiter:
    ready: Callable[[], bool]
    requests: int
    tokens: int
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    left: asyncio.Event = field(default_factory=asyncio.Event)  # set as its wait() returns or raises


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

    async def wait(self, ready: Callable[[], bool], requests: int, tokens: int, longest_s: float,
                   gone: Callable[[], Awaitable[bool]] | None = None) -> float:
        """Return at once when the line is empty and ``ready()`` is true; otherwise join the line
        and return when this call reaches its head with ``ready()`` true, or after ``longest_s``
        seconds, whichever is first. ``requests`` and ``tokens`` (its engine requests and their
        prompt tokens) count in :meth:`queued` while it waits. Returns the seconds it waited.

        Raises:
            ConnectionAbortedError: ``gone()`` said its client went away (it left the line).
            asyncio.CancelledError: the awaiting task was cancelled (it left the line).
        """
        if not self._line and _checked(ready):
            return 0.0
        loop = asyncio.get_running_loop()
        begun = self._clock()
        waiter = _Waiter(ready, requests, tokens)
        self._line.append(waiter)
        self.num_held += 1
        if self._poller is None or self._poller.done() or self._poller.get_loop() is not loop:
            self._poller = loop.create_task(self._poll())
        try:
            while not waiter.future.done():
                left = begun + max(0.0, longest_s) - self._clock()
                if left <= 0:
                    self.num_released_by_time += 1
                    break
                try:
                    await asyncio.wait_for(asyncio.shield(waiter.future), min(left, GONE_POLL_S))
                except TimeoutError:
                    if gone is not None and await gone():
                        raise ConnectionAbortedError("the client went away while its call was held") from None
        finally:
            if waiter in self._line:
                self._line.remove(waiter)
            waiter.left.set()  # the poller resumes after this task's next await: after the caller's dispatch
        return self._clock() - begun

    async def _poll(self) -> None:
        while self._line:
            while self._line and self._line[0].future.done():
                self._line.popleft()
            if self._line and _checked(self._line[0].ready):
                waiter = self._line.popleft()
                waiter.future.set_result(None)
                with contextlib.suppress(TimeoutError):  # its task dispatches it now: the next check sees it
                    await asyncio.wait_for(waiter.left.wait(), RESUME_TIMEOUT_S)
                continue
            await asyncio.sleep(self.poll_s)


def _checked(ready: Callable[[], bool]) -> bool:
    """``ready()``, or True when it raises (the call then goes; its admission answers it)."""
    try:
        return ready()
    except Exception:  # noqa: BLE001 - a failing check must not strand the line
        return True
