"""The decision deadline: a call whose media work outlasts it is decided then (mm_serve/pipeline/decision_deadline.py)."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path

import pytest

from mm_serve.admission.media_load import MediaLoad, MediaWork
from mm_serve.admission.rejection import Rejection
from mm_serve.config import load_config
from mm_serve.engine.engine_holder import EngineHolder
from mm_serve.pipeline.decision_deadline import _BACKGROUND, within_deadline


class Work:
    """Media work of ``seconds``: records when it ended and whether it still held its bytes."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.ended_at, self.holding = seconds, None, False

    async def __call__(self) -> str:
        self.holding = True
        try:
            await asyncio.sleep(self.seconds)
            self.ended_at = time.monotonic()
            return "prompt"
        finally:
            self.holding = False


def test_work_done_before_the_deadline_is_decided_after_it_as_before() -> None:
    checks: list[float] = []

    async def main() -> tuple[str, bool]:
        return await within_deadline(Work(0.01)(), time.monotonic() + 1.0, checks.append)

    assert asyncio.run(main()) == ("prompt", False) and checks == []


def test_without_a_deadline_the_work_is_awaited_however_long() -> None:
    checks: list[float] = []

    async def main() -> tuple[str, bool]:
        return await within_deadline(Work(0.2)(), None, checks.append)

    assert asyncio.run(main()) == ("prompt", False) and checks == []


def test_work_still_waiting_for_image_bytes_at_the_deadline_is_checked_but_decided_again_after_it() -> None:
    """Its wait for the byte budget is not all priced: checked at the deadline (it may be refused there) but
    not committed, so the check after its media work (with the whole wait in its TTFT) decides it too; the
    same work with its bytes held by then is checked and committed."""
    for waiting, expected in ((True, (("prompt", False), 1)), (False, (("prompt", True), 1))):
        checks: list[float] = []

        async def main(waiting: bool = waiting, checks: list[float] = checks) -> tuple[str, bool]:
            return await within_deadline(Work(0.2)(), time.monotonic() + 0.05, checks.append, defer=lambda: waiting)

        assert (asyncio.run(main()), len(checks)) == expected


def test_work_past_the_deadline_is_checked_then_and_committed_when_it_passes() -> None:
    checks: list[float] = []

    async def main() -> tuple[tuple[str, bool], float]:
        start = time.monotonic()
        out = await within_deadline(Work(0.3)(), start + 0.05, checks.append)
        return out, time.monotonic() - start

    (result, took) = asyncio.run(main())
    assert result == ("prompt", True) and took >= 0.3
    assert len(checks) == 1 and 0.04 <= checks[0] < 0.25  # the media work still expected: as long as it ran


def test_a_refusal_at_the_deadline_comes_at_once_and_the_work_ends_in_the_background_holding_its_bytes() -> None:
    work = Work(0.4)

    def refuse(expected_s: float) -> None:
        raise Rejection(429, "ttft_slo", f"predicted miss with {expected_s:.2f} s to go", 1.0)

    async def main() -> tuple[float, bool, float | None]:
        start = time.monotonic()
        with pytest.raises(Rejection, match="predicted miss"):
            await within_deadline(work(), start + 0.05, refuse)
        refused_after = time.monotonic() - start
        still_holding = work.holding
        await asyncio.sleep(0.6)
        return refused_after, still_holding, work.ended_at and work.ended_at - start

    refused_after, still_holding, ended = asyncio.run(main())
    assert 0.04 <= refused_after < 0.3  # not after the 0.4 s of work
    assert still_holding  # the bytes stay held while the work runs on
    assert ended is not None and ended >= 0.4 and not work.holding
    gc.collect()
    assert not _BACKGROUND  # forgotten once done


def test_a_failure_of_the_work_reaches_the_caller() -> None:
    async def broken() -> str:
        await asyncio.sleep(0.01)
        raise ValueError("undecodable image")

    async def main() -> None:
        await within_deadline(broken(), time.monotonic() + 1.0, lambda s: None)

    with pytest.raises(ValueError, match="undecodable"):
        asyncio.run(main())


def test_the_work_joins_the_media_load_which_gives_the_expectation() -> None:
    load = MediaLoad(cores=2)
    now = time.monotonic()
    for i in range(4):  # 4 calls of 1 MP in the phase together over the last 0.4 s: 0.1 s each
        load.leave(load.enter(MediaWork(1, 1.0), now - 0.5), now - 0.4 + 0.1 * i)
    checks: list[float] = []

    async def main() -> tuple[str, bool]:
        ahead = load.enter(MediaWork(1, 2.0))  # a call of 2 MP ahead, still running
        try:
            return await within_deadline(Work(0.2)(), time.monotonic() + 0.05, checks.append, load, MediaWork(1, 1.0))
        finally:
            assert load.in_flight() == 1  # this work has left; the one ahead has not
            load.leave(ahead)

    assert asyncio.run(main()) == ("prompt", True)
    # its 1 MP and the 2 MP ahead as those calls cost: about three of them
    assert len(checks) == 1 and 0.2 < checks[0] < 0.45, checks


def test_the_drain_waits_for_calls_still_decoding_their_images(tiny_llava: Path) -> None:
    """A SIGTERM drain waits, within its grace, for the calls ``preparing`` counts (their answer,
    503 once their images are decoded, must not be cut off by the server's exit), and counts
    those still preparing at its deadline as left in flight."""
    holder = EngineHolder(tiny_llava, load_config(None, {"model": str(tiny_llava)}))
    decoding = [3]

    def preparing() -> int:
        decoding[0] = max(0, decoding[0] - 1)  # one call gets through per poll
        return decoding[0]

    start = time.monotonic()
    assert holder.drain(5.0, preparing) == 0 and decoding[0] == 0
    assert holder.draining.is_set() and time.monotonic() - start < 1.0
    start = time.monotonic()
    assert holder.drain(0.2, lambda: 2) == 2 and 0.2 <= time.monotonic() - start < 1.0
