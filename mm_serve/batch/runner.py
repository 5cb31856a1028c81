"""Runs every unfinished batch on the server's event loop: start, resume, cancel, expire, finalize.

One asyncio task per batch. A batch's life (statuses are OpenAI's):

1. ``validating``: created (its file already checked); the task waits until the
   engine is ready, reads the file again and moves it to ``in_progress``.
2. ``in_progress``: its results file is opened by the caption job's resumable
   writer (:class:`~mm_serve.caption.output.OutputFile`): the ``custom_id`` s
   already there are done and skipped, a partial last line (a kill mid-write) is
   cut. The remaining rows run in the caption job loop
   (:class:`~mm_serve.caption.runner.CaptionJob`), each row appended (flushed, so
   it survives SIGKILL) before it is counted in ``request_counts``. A row is
   therefore in the output once, and a row that finished is never run again.
3. ``finalizing``: every row has a result; the results are split into the output
   and error files (:mod:`~mm_serve.batch.finalize`), recorded together with the
   final status in one transaction: ``completed``.

``cancelling`` (``POST /v1/batches/{id}/cancel``) stops the rows in flight (they
are aborted in the engine) and finishes as ``cancelled`` with the rows done so
far. At ``expires_at`` (``batch.completion_window_s`` after creation) rows not
done get a ``batch_expired`` error row and the batch finishes as ``expired``. A
batch whose input file can no longer be read finishes as ``failed``.

When the engine stops taking requests mid-batch (a worker restarting with no other
path to serve), the rows in flight are aborted unwritten and the task waits for the
engine, then runs the rows left. When the server stops, the tasks stop with the batch
still ``in_progress`` (or ``cancelling``); the next start resumes it from step 2 (or
finishes the cancel).
"""

from __future__ import annotations

import asyncio
import sys
import time
import traceback
from typing import Any

from mm_serve.batch.files import FileStore
from mm_serve.batch.finalize import count_results, split_results
from mm_serve.batch.records import BatchRecord, BatchStatus, FileRecord
from mm_serve.batch.row_backend import RowBackend
from mm_serve.batch.store import BatchStore
from mm_serve.batch.validation import BatchFileError, read_batch_file
from mm_serve.caption.inputs import CaptionInput
from mm_serve.caption.output import OutputFile
from mm_serve.caption.records import Outcome, batch_row, row_succeeded
from mm_serve.caption.runner import CaptionJob
from mm_serve.pipeline.context import ServerContext

ENGINE_POLL_S = 0.2
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."


class BatchRunner:
    """Owns the tasks of the running batches (call every method on the server's event loop).

    Args:
        ctx: the server context (engine, config).
        store: the batch database.
        files: the file contents.
    """

    def __init__(self, ctx: ServerContext, store: BatchStore, files: FileStore) -> None:
        self.ctx = ctx
        self.store = store
        self.files = files
        self.backend = RowBackend(ctx, asyncio.Semaphore(ctx.config.batch.max_in_flight_rows))
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stops: dict[str, asyncio.Event] = {}
        self._closing = False

    def launch(self, batch_id: str) -> None:
        """Start (or resume) the task of ``batch_id`` unless it is already running."""
        if self._closing or batch_id in self._tasks:
            return
        self._stops[batch_id] = asyncio.Event()
        self._tasks[batch_id] = asyncio.ensure_future(self._guarded(batch_id))

    def stop(self, batch_id: str) -> None:
        """Ask the task of ``batch_id`` to stop its rows (after a cancel was recorded)."""
        event = self._stops.get(batch_id)
        if event is not None:
            event.set()

    async def close(self) -> None:
        """Stop every task: rows in flight are aborted, batches stay resumable."""
        self._closing = True
        for event in self._stops.values():
            event.set()
        if self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _guarded(self, batch_id: str) -> None:
        try:
            await self._run(batch_id)
        except Exception:  # a bug must not take the server down; the batch resumes on the next start
            print(f"mm-serve: batch {batch_id} stopped by an internal error:", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
        finally:
            self._tasks.pop(batch_id, None)
            self._stops.pop(batch_id, None)

    async def _run(self, batch_id: str) -> None:
        stop = self._stops[batch_id]
        if not await self._wait_for_engine(batch_id, stop):
            return
        record = self.store.get_batch(batch_id)
        if record is None or record.finished:
            return
        items = await self._items(record)
        if items is None:
            return
        record = self.store.get_batch(batch_id) or record  # a cancel may have come while the file was read
        if record.status == "validating":  # (no await from here to the update: a cancel cannot slip in)
            self.store.update_batch(batch_id, status="in_progress", in_progress_at=_now())
            record.status = "in_progress"
        while record.status == "in_progress":
            engine_lost = await self._run_rows(record, items, stop)
            record = self.store.get_batch(batch_id) or record
            if not engine_lost or stop.is_set() or self._closing or record.status != "in_progress":
                break
            # the engine stopped taking requests mid-batch (a worker restarting, no path serving): the rows
            # left wait for it here, as the batch's start did, instead of for the next server start
            await asyncio.sleep(ENGINE_POLL_S)
            if self._closing or not await self._wait_for_engine(batch_id, stop):
                return
            record = self.store.get_batch(batch_id) or record
        await self._finish(record, items)

    async def _wait_for_engine(self, batch_id: str, stop: asyncio.Event) -> bool:
        """Wait until the engine takes requests, or until the batch is cancelled or expires (finishing
        those needs no engine); False when the server stops first or its engine failed to start."""
        record = self.store.get_batch(batch_id)
        expires_at = record.expires_at if record is not None else 0
        while not self.backend.engine_up():
            if self.ctx.holder.start_error is not None or self._closing:
                return False
            if stop.is_set() or time.time() >= expires_at:
                return True
            await asyncio.sleep(ENGINE_POLL_S)
        return True

    async def _items(self, record: BatchRecord) -> list[CaptionInput] | None:
        """The rows of the input file; a file that is gone or no longer valid fails the batch."""
        input_file = self.store.get_file(record.input_file_id)
        try:
            if input_file is None:
                raise BatchFileError(f"the input file {record.input_file_id} no longer exists")
            path = self.files.path(input_file.id)
            return await asyncio.to_thread(read_batch_file, path, input_file.filename, record.endpoint,
                                           self.ctx.config)
        except BatchFileError as exc:
            self.store.update_batch(record.id, status="failed", failed_at=_now(),
                                    errors=[{"code": "invalid_input_file", "message": str(exc), "line": None,
                                             "param": "input_file_id"}])
            self.files.results_path(record.id).unlink(missing_ok=True)
            return None

    async def _run_rows(self, record: BatchRecord, items: list[CaptionInput], stop: asyncio.Event) -> bool:
        """Run the rows without a result yet, until all have one, ``stop`` is set, or the engine goes away;
        whether it went away (rows stopped unwritten, to run again once it is back)."""
        path = self.files.results_path(record.id)
        out, resume = await asyncio.to_thread(OutputFile.open, path, "openai-batch",
                                              fsync=self.ctx.config.batch.fsync)
        try:
            counts = list(await asyncio.to_thread(count_results, path))
            self.store.update_batch(record.id, completed=counts[0], failed=counts[1])
            todo = [item for item in items if item.id not in resume.done]
            if time.time() >= record.expires_at:
                return False
            timer = asyncio.get_running_loop().call_later(max(0.0, record.expires_at - time.time()), stop.set)

            def count(row: dict[str, Any]) -> None:
                counts[0 if row_succeeded(row) else 1] += 1
                self.store.update_batch(record.id, completed=counts[0], failed=counts[1])

            # with api.cache_salt_by_api_key the batches of one key are a tenant of their own: their rows share
            # caches with each other, never with another key's batches or with interactive calls (the runner
            # keeps the key's fingerprint, not the key); a batch without an owner is a tenant alone
            tenant = ((f"batch-owner:{record.owner}" if record.owner else f"batch:{record.id}")
                      if self.ctx.config.api.cache_salt_by_api_key else "")
            backend = RowBackend(self.ctx, self.backend.slots, tenant)
            job = CaptionJob(todo, "openai-batch", backend, out, concurrency=backend.default_concurrency,
                             skipped=len(items) - len(todo), on_row=count)
            try:
                stats = await job.run(stop)
            finally:
                timer.cancel()
            return stats.fatal_error is not None
        finally:
            await asyncio.to_thread(out.close)

    async def _finish(self, record: BatchRecord, items: list[CaptionInput]) -> None:
        """Finalize a batch whose rows are all done, cancelled or expired; leave any other to resume."""
        path = self.files.results_path(record.id)
        if record.status == "cancelling":
            await self._finalize(record, items, "cancelled")
            return
        if record.status not in ("in_progress", "finalizing"):
            return
        if record.status == "in_progress":
            done = record.completed + record.failed
            if done < len(items) and time.time() >= record.expires_at:
                await asyncio.to_thread(self._write_expired, path, items)
                await self._finalize(record, items, "expired")
                return
            if done < len(items):
                return  # stopped (server stopping, engine down): resumed later
            self.store.update_batch(record.id, status="finalizing", finalizing_at=_now())
        await self._finalize(record, items, "completed")

    def _write_expired(self, path: Any, items: list[CaptionInput]) -> None:
        """Append a ``batch_expired`` error row for every row without a result."""
        out, resume = OutputFile.open(path, "openai-batch", fsync=self.ctx.config.batch.fsync)
        try:
            for item in items:
                if item.id not in resume.done:
                    out.append(batch_row(item, Outcome(latency_s=0.0, error=EXPIRED_MESSAGE, error_code="batch_expired")))
        finally:
            out.close()

    async def _finalize(self, record: BatchRecord, items: list[CaptionInput], status: BatchStatus) -> None:
        """Split the results into output and error files; record them and ``status`` in one transaction."""
        path = self.files.results_path(record.id)
        rows = await asyncio.to_thread(split_results, path, items)
        written: list[FileRecord] = []
        if rows.succeeded:
            written.append(await asyncio.to_thread(self.files.write_output, rows.succeeded, f"{record.id}_output.jsonl",
                                                   record.owner))
        if rows.failed:
            written.append(await asyncio.to_thread(self.files.write_output, rows.failed, f"{record.id}_error.jsonl",
                                                   record.owner))
        output_id = written[0].id if rows.succeeded else None
        error_id = written[-1].id if rows.failed else None
        self.store.finish_batch(record.id, written, status=status, **{f"{status}_at": _now()},
                                output_file_id=output_id, error_file_id=error_id,
                                completed=len(rows.succeeded), failed=len(rows.failed))
        path.unlink(missing_ok=True)


def _now() -> int:
    return int(time.time())
