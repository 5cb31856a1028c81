"""The job loop: a bounded window of in-flight inputs, rows written as they finish, a progress bar.

Up to ``concurrency`` inputs are in flight at once; as soon as one finishes its
row is written (flushed) and the next input starts, so the service always has
``concurrency`` requests to batch. Rows are written in completion order by
default; with ``in_order`` a finished row waits until every earlier input's row
is written (input order, within one uninterrupted run).

Stopping: when the ``stop`` event is set (the CLI sets it on SIGINT/SIGTERM) or
the backend raises :class:`FatalBackendError`, no new input starts, the in-flight
ones are cancelled (aborted in the service), and every row already finished,
including rows held back by ``in_order``, is written before :meth:`CaptionJob.run`
returns. Inputs without a row are simply done by the next run (resume).
"""

from __future__ import annotations

import asyncio
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from mm_serve.caption.backends import CaptionBackend, FatalBackendError
from mm_serve.caption.inputs import CaptionInput, InputFormat
from mm_serve.caption.output import OutputFile
from mm_serve.caption.records import Outcome, failure, output_row
from mm_serve.caption.summary import JobStats


class CaptionJob:
    """Runs ``items`` through ``backend`` into ``out``.

    Args:
        items: the inputs still to do (already-done ones removed), in input order.
        fmt: the input format; it picks the row layout.
        backend: a ready backend (not owned: the caller closes it).
        out: the open output file (not owned).
        concurrency: inputs in flight at most (>= 1).
        in_order: write rows in input order instead of completion order.
        skipped: inputs already done before this run (for the progress bar and summary).
        show_progress: draw a tqdm bar on stderr (done/total, images/s, ETA, failed).
        on_row: called with each row right after it is written to ``out`` (e.g. to count it).
    """

    def __init__(self, items: Sequence[CaptionInput], fmt: InputFormat, backend: CaptionBackend, out: OutputFile,
                 *, concurrency: int, in_order: bool = False, skipped: int = 0, show_progress: bool = False,
                 on_row: Callable[[dict[str, Any]], None] | None = None) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.items, self.fmt, self.backend, self.out = list(items), fmt, backend, out
        self.concurrency, self.in_order = concurrency, in_order
        self.stats = JobStats(total=len(self.items) + skipped, skipped=skipped)
        self._show_progress = show_progress
        self._on_row = on_row
        self._tasks: dict[asyncio.Task[Outcome], int] = {}
        self._held: dict[int, dict[str, Any]] = {}  # finished rows waiting for earlier ones (in_order)
        self._next_row = 0
        self._reported_internal_error = False

    async def run(self, stop: asyncio.Event | None = None) -> JobStats:
        """Run until every input has a row, ``stop`` is set, or the service goes away."""
        stop = stop or asyncio.Event()
        stopper = asyncio.ensure_future(stop.wait())
        bar = tqdm(total=self.stats.total, initial=self.stats.skipped, unit="img", desc="caption",
                   dynamic_ncols=True, smoothing=0.05, disable=not self._show_progress, file=sys.stderr)
        source: Iterator[tuple[int, CaptionInput]] = iter(enumerate(self.items))
        start = time.perf_counter()
        try:
            while True:
                self._fill(source)
                if not self._tasks:
                    break
                done, _ = await asyncio.wait([*self._tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
                for task in sorted((t for t in self._tasks if t in done), key=self._tasks.__getitem__):
                    self._collect(task, bar)
                if stopper in done:
                    self.stats.interrupted = True
                if self.stats.interrupted or self.stats.fatal_error:
                    break
        finally:
            stopper.cancel()
            await self._cancel_in_flight(bar)
            self._write_held(everything=True)
            self.stats.wall_s = time.perf_counter() - start
            bar.close()
        return self.stats

    def _fill(self, source: Iterator[tuple[int, CaptionInput]]) -> None:
        """Start inputs until the window is full or the inputs run out."""
        while len(self._tasks) < self.concurrency:
            nxt = next(source, None)
            if nxt is None:
                return
            index, item = nxt
            self._tasks[asyncio.ensure_future(self._run_one(item))] = index

    async def _run_one(self, item: CaptionInput) -> Outcome:
        """``backend.run`` with any unexpected exception turned into that input's error row."""
        try:
            return await self.backend.run(item)
        except (FatalBackendError, asyncio.CancelledError):
            raise
        except Exception as exc:  # a bug must cost one row, not the job; the first traceback is shown
            if not self._reported_internal_error:
                self._reported_internal_error = True
                traceback.print_exc(file=sys.stderr)
            return failure(0.0, f"internal error: {type(exc).__name__}: {exc}", "internal_error")

    def _collect(self, task: asyncio.Task[Outcome], bar: Any) -> None:
        """Record a finished task: count it, write (or hold) its row, note a fatal error."""
        index = self._tasks.pop(task)
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, FatalBackendError):
            self.stats.fatal_error = self.stats.fatal_error or str(exc)
            return
        if exc is not None:
            raise exc
        outcome = task.result()
        self.stats.add(outcome)
        bar.update(1)
        if not outcome.ok:
            bar.set_postfix(failed=self.stats.failed, refresh=False)
        row = output_row(self.fmt, self.items[index], outcome)
        if not self.in_order:
            self._write(row)
            return
        self._held[index] = row
        self._write_held(everything=False)

    def _write(self, row: dict[str, Any]) -> None:
        self.out.append(row)
        if self._on_row is not None:
            self._on_row(row)

    def _write_held(self, everything: bool) -> None:
        """Write held rows in input order: the contiguous run from the next index, or all of them."""
        while self._next_row in self._held:
            self._write(self._held.pop(self._next_row))
            self._next_row += 1
        if everything:
            for index in sorted(self._held):
                self._write(self._held.pop(index))

    async def _cancel_in_flight(self, bar: Any) -> None:
        """Cancel every in-flight input; ones that finished meanwhile are still recorded."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            self._collect(task, bar)
