"""The media threads: at most ``threads`` steps at once, tighter ranks first, abandoned steps never run
(mm_serve/media/media_runner.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from mm_serve.media.media_runner import MediaAbandoned, MediaRunner, default_threads


def test_steps_run_one_at_a_time_and_the_tighter_rank_goes_first() -> None:
    """One thread: a batch-rank step holds it; then a batch, a standard and an interactive step queue,
    in that order. They run interactive, standard, batch, each alone on the thread."""
    order: list[str] = []
    running, most = [0], [0]
    lock = threading.Lock()
    release = threading.Event()

    def step(name: str, wait: bool = False) -> str:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        if wait:
            release.wait(10)
        else:
            time.sleep(0.01)
        with lock:
            running[0] -= 1
            order.append(name)
        return name.upper()

    async def main() -> list[str]:
        runner = MediaRunner(1)
        first = asyncio.ensure_future(runner.turns(2)(step, "first", True))
        await asyncio.sleep(0.05)
        assert runner.busy() == 1
        queued = [asyncio.ensure_future(runner.turns(rank)(step, name)) for rank, name in
                  ((2, "batch"), (1, "standard"), (0, "interactive"))]
        await asyncio.sleep(0.05)
        assert runner.waiting() == 3
        release.set()
        results = await asyncio.gather(first, *queued)
        assert runner.busy() == 0 and runner.waiting() == 0
        runner.close()
        return list(results)

    assert asyncio.run(main()) == ["FIRST", "BATCH", "STANDARD", "INTERACTIVE"]
    assert order == ["first", "interactive", "standard", "batch"]
    assert most[0] == 1


def test_an_abandoned_call_runs_no_step_that_has_not_begun() -> None:
    """Two threads busy; a call's step waits for one. Abandoned, that step raises MediaAbandoned without
    running, and so does every later step of the call; the slot goes to the next call."""
    ran: list[str] = []
    release = threading.Event()

    def step(name: str) -> None:
        if name.startswith("busy"):
            release.wait(10)
        ran.append(name)

    async def main() -> None:
        runner = MediaRunner(2)
        busy = [asyncio.ensure_future(runner.turns(0)(step, f"busy{i}")) for i in range(2)]
        await asyncio.sleep(0.05)
        refused = runner.turns(0)
        waiting = asyncio.ensure_future(refused(step, "refused"))
        other = asyncio.ensure_future(runner.turns(1)(step, "other"))
        await asyncio.sleep(0.05)
        refused.abandon()
        with pytest.raises(MediaAbandoned):
            await waiting
        with pytest.raises(MediaAbandoned):
            await refused(step, "refused again")
        release.set()
        await asyncio.gather(*busy, other)
        assert runner.busy() == 0
        runner.close()

    asyncio.run(main())
    assert sorted(ran) == ["busy0", "busy1", "other"]


def test_a_step_cancelled_while_it_waits_gives_its_place_up_and_one_running_keeps_its_slot() -> None:
    """A waiting step whose task is cancelled leaves the line; a running step whose task is cancelled
    keeps its thread (it cannot be stopped) until it ends, so no more than ``threads`` run at once."""
    started: list[str] = []
    release = threading.Event()

    def step(name: str) -> str:
        started.append(name)
        if name == "long":
            release.wait(10)
        return name

    async def main() -> None:
        runner = MediaRunner(1)
        long = asyncio.ensure_future(runner.turns(0)(step, "long"))
        await asyncio.sleep(0.05)
        waiter = asyncio.ensure_future(runner.turns(0)(step, "cancelled"))
        await asyncio.sleep(0.02)
        waiter.cancel()
        long.cancel()
        await asyncio.sleep(0.02)
        late = asyncio.ensure_future(runner.turns(0)(step, "late"))
        await asyncio.sleep(0.05)
        assert started == ["long"] and runner.busy() == 1  # the cancelled long step still holds its thread
        release.set()
        assert await late == "late"
        assert runner.busy() == 0 and runner.waiting() == 0
        runner.close()
        assert await runner.turns(0)(step, "after close") == "after close"  # a new pool
        runner.close()

    asyncio.run(main())
    assert started == ["long", "late", "after close"]


def test_threads_must_be_at_least_one_and_the_default_leaves_cores_to_the_workers() -> None:
    with pytest.raises(ValueError, match="threads"):
        MediaRunner(0)
    assert [default_threads(cores) for cores in (1, 2, 3, 16)] == [1, 1, 1, 8]


def test_the_threads_run_nice_levels_below_the_process() -> None:
    import os

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    base = os.getpriority(os.PRIO_PROCESS, 0)

    async def main() -> int:
        runner = MediaRunner(1, nice=3)
        try:
            return await runner.turns(0)(niceness)
        finally:
            runner.close()

    assert asyncio.run(main()) == min(19, base + 3)
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the process (its event loop) keeps its own
    with pytest.raises(ValueError, match="nice"):
        MediaRunner(1, nice=-1)
