"""The API process's media CPU work (decoding images and videos, the image processor) on a few threads,
tighter calls first.

A call's media work runs in the API process, whose threads share the machine's cores with the
workers. Run on as many threads as calls bring images (``asyncio.to_thread``'s pool has
``cpu_count + 4``) at the event loop's priority, a flood of photos (a 24 MP JPEG is ~0.3 s of one core
to decode and resize) takes the cores from the workers, and each running request's decode step
stretches with it: on a 2-core machine, TPOTs of 250-370 ms against ~5 ms unloaded
(``benchmarks/tier_overload.py``). Here each call's CPU steps wait for one of ``threads`` slots,
granted by rank (the call's SLO tier: tighter first), then arrival, and run on a pool of that many
threads, each ``nice`` levels below the process (the server gives them the workers'
``compute.worker_nice``: decoding new calls' images is bulk work, as the workers' steps are, while the
event loop keeps its priority). Calls without images do not come here: their tokenizing stays on
``asyncio.to_thread``.

A call refused before its media work is done has its turns abandoned (:meth:`MediaTurns.abandon`): its
steps that have not begun never run (:class:`MediaAbandoned`), the one running (a thread cannot be
stopped) finishes.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import os
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class MediaAbandoned(Exception):
    """A step of a call whose media work was abandoned (the call was refused meanwhile)."""


class RunCPU(Protocol):
    """Runs ``fn(*args)`` off the event loop and returns its result (``asyncio.to_thread``'s shape)."""

    def __call__(self, fn: Callable[..., T], /, *args: Any) -> Awaitable[T]: ...


def default_threads(cores: int) -> int:
    """Half of ``cores`` (those the server may run on), at least one: the rest stay with the workers."""
    return max(1, cores // 2)


class MediaRunner:
    """``threads`` slots for media CPU steps, granted lowest rank first, then first come; the steps run on
    a pool of ``threads`` threads, ``nice`` added to each one's niceness. Used from one event loop.

    Raises (constructor):
        ValueError: ``threads < 1`` or ``nice < 0``.
    """

    def __init__(self, threads: int, nice: int = 0) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if nice < 0:
            raise ValueError(f"nice must be >= 0, got {nice}")
        self.threads = threads
        self.nice = nice
        self._pool = self._new_pool()
        self._busy = 0  # slots granted and not yet given back
        self._line: list[tuple[int, int, asyncio.Future[None]]] = []  # heap of (rank, arrival, grant)
        self._arrivals = itertools.count()

    def turns(self, rank: int) -> MediaTurns:
        """The steps of one call of ``rank`` (lower goes first)."""
        return MediaTurns(self, rank)

    def waiting(self) -> int:
        """Steps waiting for a slot now."""
        return sum(not grant.done() for _, _, grant in self._line)

    def busy(self) -> int:
        """Slots in use now."""
        return self._busy

    def close(self) -> None:
        """Let the pool's threads go once the steps on them finish (a later step starts a new pool)."""
        pool, self._pool = self._pool, self._new_pool()
        pool.shutdown(wait=False, cancel_futures=True)

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(self.threads, thread_name_prefix="media", initializer=_lower_priority,
                                  initargs=(self.nice,))

    def _ask(self, rank: int) -> asyncio.Future[None]:
        grant: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._line, (rank, next(self._arrivals), grant))
        self._grant()
        return grant

    def _grant(self) -> None:
        while self._line and self._busy < self.threads:
            _, _, grant = heapq.heappop(self._line)
            if not grant.done():  # a waiter that left (cancelled, abandoned) is skipped
                self._busy += 1
                grant.set_result(None)

    def _give_back(self) -> None:
        self._busy -= 1
        self._grant()

    async def _run(self, turns: MediaTurns, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        grant = self._ask(turns.rank)
        turns.pending.add(grant)
        try:
            await grant
        except asyncio.CancelledError:
            if grant.done() and not grant.cancelled():  # granted as the task was cancelled: not used
                self._give_back()
            raise
        finally:
            turns.pending.discard(grant)
        if turns.abandoned:
            self._give_back()
            raise MediaAbandoned("the call was refused before this step of its media work began")
        loop = asyncio.get_running_loop()
        step: Future[T] = self._pool.submit(fn, *args)
        step.add_done_callback(lambda _: _call_soon(loop, self._give_back))  # when its thread is done, not before
        return await asyncio.wrap_future(step)


class MediaTurns:
    """One call's media CPU steps on a :class:`MediaRunner`; call it as ``asyncio.to_thread`` is called.

    Raises (call):
        MediaAbandoned: the call was abandoned before the step began.
        Exception: whatever the step raises.
    """

    def __init__(self, runner: MediaRunner, rank: int) -> None:
        self.runner = runner
        self.rank = rank
        self.abandoned = False
        self.pending: set[asyncio.Future[None]] = set()  # its steps waiting for a slot

    def __call__(self, fn: Callable[..., T], /, *args: Any) -> Awaitable[T]:
        if self.abandoned:
            raise MediaAbandoned("the call was refused before this step of its media work began")
        return self.runner._run(self, fn, args)

    def abandon(self) -> None:
        """No more of this call's steps begin; those waiting for a slot raise :class:`MediaAbandoned`."""
        self.abandoned = True
        for grant in list(self.pending):
            if not grant.done():
                grant.set_exception(MediaAbandoned("the call was refused before this step of its media work began"))


def _lower_priority(nice: int) -> None:
    """Add ``nice`` to the calling thread's niceness (Linux: a thread is a task of its own)."""
    if nice and hasattr(os, "setpriority"):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:  # the loop has closed: nothing waits for the slot any more
        pass
