"""Decide a call's admission within a deadline from its arrival, whatever its media work takes.

A call that passes the early check (:func:`mm_serve.pipeline.gate.precheck_call`, before its
images are fetched and decoded and its prompts tokenized) is decided again once that media work
is done, on its exact prompt. Under a burst of images that work can take hundreds of
milliseconds (the API process's threads and the workers share the cores), so a refusal after it
came late. With ``admission.decide_within_ms``, a call whose media work is still running at
``arrival + decide_within_ms`` is decided then: the early check is made again with the time
waited so far plus the media work still expected
(:meth:`~mm_serve.admission.media_load.MediaLoad.expected_remaining`: the calls in that phase
ahead of it and its own, by their prompts and their images' size, at what such work has cost lately).

* Refused there, the call is answered at once and its media work is abandoned: the steps that
  have not begun never run (:meth:`~mm_serve.media.media_runner.MediaTurns.abandon`); the one
  running ends in the background with its image bytes still held (the memory bound counts them
  until they are freed).
* Passed there, the call is *committed*: the check after its media work still applies the hard
  bounds (queue caps, the work limit) but no longer refuses it on the prediction.
* A call still waiting for room in the image byte budget at its deadline is checked with every call
  with images that entered before it counted ahead (they hold the bytes it waits for, whatever their
  tier), and passed, is decided again after its media work, not committed: committed there, such a call
  could wait up to ``admission.image_wait_s`` after it (a first token 10 s late on a 1 s SLO).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from mm_serve.admission.media_load import MediaLoad, MediaWork

T = TypeVar("T")

_BACKGROUND: set[asyncio.Future[object]] = set()  # media work of refused calls, running to its end


def _forget(task: asyncio.Future[object]) -> None:
    _BACKGROUND.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: a failure of work nobody waits for is not logged as lost


async def within_deadline(work: Awaitable[T], deadline: float | None, recheck: Callable[[float], None],
                          load: MediaLoad | None = None, size: MediaWork | None = None,
                          learn: Callable[[], bool] = lambda: True,
                          abandon: Callable[[], None] | None = None, rank: int | None = 0,
                          defer: Callable[[], bool] | None = None) -> tuple[T, bool]:
    """Await ``work`` (a call's media work); if it is not done by ``deadline``, decide then.

    Args:
        work: the media work; it holds what it needs (image bytes) for as long as it runs.
        deadline: ``time.monotonic()`` seconds by which the call is decided, or None (no
            deadline: the call is decided after its media work, however long it takes).
        recheck: the early admission check, called with the seconds of media work still
            expected; raises to refuse.
        load: the media work in flight, which ``work`` joins until it ends; it gives the
            expectation (without it: as long again as the work has run).
        size: the work for ``load`` (:func:`~mm_serve.pipeline.gate.media_size`; None: one prompt, no image).
        learn: asked when the work ends: whether ``load`` may learn from its time (:meth:`MediaLoad.leave`).
        abandon: called when ``recheck`` refuses: the work's steps not yet begun are not to run.
        rank: the work's place in the media threads' line (:meth:`MediaLoad.enter`; None: not in it).
        defer: asked at the deadline: True while the work waits for the image byte budget. The check is
            then made with every call with images that entered before it counted ahead
            (:meth:`MediaLoad.expected_remaining` with ``in_line`` False: they hold the bytes it waits for),
            and passed, the call is decided again after the work, not committed (that wait is not all
            priced: calls held before their media work hold bytes too).

    Returns:
        (the work's result, committed): committed is True when the call was decided at the
        deadline, and so must not be refused on its prediction after its media work.

    Raises:
        Rejection: from ``recheck`` (the work then goes on in the background, unawaited).
        Exception: whatever ``work`` raises.
    """
    started = time.monotonic()
    task = asyncio.ensure_future(work)
    if load is not None:
        ticket = load.enter(size or MediaWork(), started, rank)
        task.add_done_callback(lambda _: load.leave(ticket, learn=learn()))
    if deadline is None:
        return await task, False
    try:
        done, _ = await asyncio.wait({task}, timeout=max(0.0, deadline - started))
    except asyncio.CancelledError:
        task.cancel()
        raise
    if done:
        return task.result(), False
    waiting = defer is not None and defer()
    try:
        now = time.monotonic()
        recheck(now - started if load is None else load.expected_remaining(ticket, now, in_line=not waiting))
    except BaseException:
        if abandon is not None:
            abandon()
        _BACKGROUND.add(task)  # type: ignore[arg-type]
        task.add_done_callback(_forget)  # type: ignore[arg-type]
        raise
    return await task, not waiting
