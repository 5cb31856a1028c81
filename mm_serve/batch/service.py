"""What the batch routes call: files and batches checked, stored and run; OpenAI errors for bad input.

The data directory (``batch.data_dir``) is opened on the first batch call, or at
start-up when it already holds a database (then every unfinished batch resumes),
so a server that never sees a batch call writes nothing. It is locked (``flock``
on ``DATA_DIR/lock``) by one server at a time; a second server on the same
directory answers batch calls with 503 and serves everything else, and takes the
directory over once the first lets it go: each batch call tries the lock again, and
a server that found a database at start-up tries every :data:`LOCK_RETRY_S` seconds
(so its unfinished batches resume without waiting for a call).

Every route's method takes the calling key's ``owner`` (:func:`mm_serve.batch.records.owner_of`;
no default, so no caller forgets it): a key sees, reads, deletes and cancels only its own files
and batches (and those made without a key); another key's are 404, as an unknown id is. ""
(a server without keys) sees all.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO

from mm_serve.batch.files import FileLimitError, FileStore
from mm_serve.batch.records import ACTIVE_STATUSES, BatchRecord, FileRecord, new_batch_id
from mm_serve.batch.runner import BatchRunner
from mm_serve.batch.store import BatchStore
from mm_serve.batch.validation import BatchFileError, read_batch_file
from mm_serve.caption.inputs import BATCH_URL, COMPLETIONS_URL
from mm_serve.config import BatchConfig
from mm_serve.pipeline.context import ServerContext
from mm_serve.protocol.errors import APIError, bad_request, unavailable

ENDPOINTS = (BATCH_URL, COMPLETIONS_URL)
COMPLETION_WINDOWS = ("24h",)
DB_NAME = "batches.sqlite3"
LOCK_RETRY_S = 5.0  # seconds between tries for a data directory another server holds (see the module docstring)


def data_dir(config: BatchConfig) -> Path:
    """``batch.data_dir``, else ``$XDG_STATE_HOME/mm-serve/batches``, else ``~/.local/state/mm-serve/batches``."""
    if config.data_dir:
        return Path(config.data_dir).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "mm-serve" / "batches"


def not_found(kind: str, object_id: str, param: str | None = None) -> APIError:
    """404 for an unknown file or batch id."""
    return APIError(404, f"no {kind} with id '{object_id}'", "not_found_error", param, f"{kind}_not_found")


@dataclass
class _Open:
    store: BatchStore
    files: FileStore
    runner: BatchRunner
    lock: IO[bytes]


class BatchService:
    """The Batch API of one server (see the module docstring); call it on the server's event loop."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.config = ctx.config.batch
        self.root = data_dir(self.config)
        self._open: _Open | None = None
        self._refusal: str | None = None  # the database cannot be used: for good (the lock is tried again)
        self._retry: asyncio.Task[None] | None = None

    def start(self) -> None:
        """At server start-up (on the event loop): open the data directory if it holds a database, and
        resume its batches; while another server holds it, try again every :data:`LOCK_RETRY_S` seconds."""
        if (self.root / DB_NAME).exists():
            try:
                self._opened()
            except APIError:  # locked by another server, or unusable: batch calls say why
                if self._refusal is None:
                    self._retry = asyncio.get_running_loop().create_task(self._open_when_free())

    async def _open_when_free(self) -> None:
        """Try the data directory every :data:`LOCK_RETRY_S` seconds until it opens (or cannot be used)."""
        while self._open is None and self._refusal is None:
            await asyncio.sleep(LOCK_RETRY_S)
            try:
                self._opened()
            except APIError:
                pass

    async def close(self) -> None:
        """Stop the running batches (resumable), close the database and release the lock."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._open is None:
            return
        opened, self._open = self._open, None
        await opened.runner.close()
        opened.store.close()
        opened.lock.close()

    def _opened(self) -> _Open:
        """The open data directory (opened, locked and resumed on first use).

        Raises:
            APIError: 503 when another server holds the directory (each call tries its lock again)
                or it cannot be opened.
        """
        if self._open is not None:
            return self._open
        if self._refusal is not None:
            raise unavailable(self._refusal)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            lock = open(self.root / "lock", "a+b")  # held (and closed) by close()
        except OSError as exc:
            raise unavailable(f"the batch data directory {self.root} cannot be used: {exc}") from None
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise unavailable(f"the batch data directory {self.root} is in use by another mm-serve process; "
                              "give this server its own batch.data_dir (this one takes it over once that "
                              "process lets it go)", retry_after_s=int(LOCK_RETRY_S)) from None
        try:
            store = BatchStore(self.root / DB_NAME)
        except sqlite3.Error as exc:  # a newer version's database, or a broken one
            lock.close()
            self._refusal = f"the batch database in {self.root} cannot be used: {exc}"
            raise unavailable(self._refusal) from None
        files = FileStore(self.root, store, self.config)
        runner = BatchRunner(self.ctx, store, files)
        active = store.active_batches()
        files.sweep({b.id for b in active})
        self._open = _Open(store, files, runner, lock)
        for record in active:
            runner.launch(record.id)
        return self._open

    # -- files -----------------------------------------------------------------------------

    async def upload(self, source: BinaryIO, filename: str | None, purpose: str, owner: str) -> dict[str, Any]:
        """Store an uploaded batch input file as ``owner``'s; the ``file`` object.

        Raises:
            APIError: 400 for a purpose other than ``batch``; 413 over ``batch.max_file_bytes``
                or ``batch.max_total_bytes``.
        """
        if purpose != "batch":
            raise bad_request(f"purpose must be 'batch' (this server stores batch input files only), got {purpose!r}",
                              "purpose")
        opened = self._opened()
        name = Path(filename or "").name or "upload.jsonl"
        try:
            record = await asyncio.to_thread(opened.files.save_upload, source, name, "batch", owner)
        except FileLimitError as exc:
            raise APIError(413, str(exc), "invalid_request_error", "file", exc.code) from None
        return record.to_openai()

    def file(self, file_id: str, owner: str) -> FileRecord:
        """The record of ``file_id``. Raises APIError 404 (also for another owner's)."""
        record = self._opened().store.get_file(file_id, owner)
        if record is None:
            raise not_found("file", file_id)
        return record

    def file_path(self, file_id: str, owner: str) -> Path:
        """Where the content of ``file_id`` is.

        Raises:
            APIError: 404 for no such file of ``owner``'s, or one whose content is gone from the store
                (removed from ``batch.data_dir`` by hand: ``file_content_missing``, the path not shown).
        """
        path = self._opened().files.path(self.file(file_id, owner).id)
        if not path.is_file():
            raise APIError(404, f"the content of file {file_id} is missing from the server's file store",
                           "not_found_error", None, "file_content_missing")
        return path

    def list_files(self, purpose: str | None, after: str | None, limit: int, order: str,
                   owner: str) -> dict[str, Any]:
        """A page of ``owner``'s files (OpenAI's list object). Raises APIError 400 for an unknown ``after``."""
        try:
            records = self._opened().store.list_files(purpose=purpose, after=after, limit=limit + 1,
                                                      newest_first=order == "desc", owner=owner)
        except KeyError:
            raise bad_request(f"'after' must be the id of a file, got {after!r}", "after") from None
        return _page([r.to_openai() for r in records], limit)

    def delete_file(self, file_id: str, owner: str) -> dict[str, Any]:
        """Delete a file. Raises APIError 404, or 409 while an unfinished batch reads it."""
        opened = self._opened()
        self.file(file_id, owner)
        readers = opened.store.batches_reading(file_id)
        if readers:  # another key's batch (on a shared ownerless file) is not named
            yours = [r for r in readers if opened.store.get_batch(r, owner) is not None]
            which = f"batch {yours[0]}, which has" if yours else "a batch that has"
            raise APIError(409, f"file {file_id} is the input of {which} not finished; cancel it or wait",
                           "invalid_request_error", "file_id", "file_in_use")
        opened.files.delete(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # -- batches ---------------------------------------------------------------------------

    async def create_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                           metadata: dict[str, str] | None, owner: str) -> dict[str, Any]:
        """Check the request and the input file line by line, store the batch as ``owner``'s and start it.

        Raises:
            APIError: 400 for an unsupported endpoint or window, bad metadata, a file that is
                not a batch input, fails validation (the message names the line) or cannot be read;
                404 for an unknown ``input_file_id`` (or another owner's).
        """
        if endpoint not in ENDPOINTS:
            raise bad_request(f"endpoint must be one of {', '.join(ENDPOINTS)} (what this server runs batches on), "
                              f"got {endpoint!r}", "endpoint", "unsupported_endpoint")
        if completion_window not in COMPLETION_WINDOWS:
            raise bad_request(f"completion_window must be '24h', got {completion_window!r}", "completion_window")
        _check_metadata(metadata)
        opened = self._opened()
        source = opened.store.get_file(input_file_id, owner)
        if source is None:
            raise not_found("file", input_file_id, "input_file_id")
        if source.purpose != "batch":
            raise bad_request(f"file {input_file_id} has purpose {source.purpose!r}; a batch's input file is "
                              "uploaded with purpose 'batch'", "input_file_id")
        try:
            items = await asyncio.to_thread(read_batch_file, opened.files.path(source.id), source.filename,
                                            endpoint, self.ctx.config)
        except BatchFileError as exc:
            raise bad_request(f"the input file {input_file_id} is not a valid batch file: {exc}", "input_file_id",
                              "invalid_batch_file") from None
        now = int(time.time())
        record = BatchRecord(id=new_batch_id(), input_file_id=input_file_id, endpoint=endpoint,
                             completion_window=completion_window, status="validating", created_at=now,
                             expires_at=now + self.config.completion_window_s, model=self.ctx.served_model_name,
                             metadata=metadata, total=len(items), owner=owner)
        opened.store.add_batch(record)
        opened.runner.launch(record.id)
        return record.to_openai()

    def batch(self, batch_id: str, owner: str) -> dict[str, Any]:
        """The ``batch`` object. Raises APIError 404 (also for another owner's)."""
        return self._batch(batch_id, owner).to_openai()

    def list_batches(self, after: str | None, limit: int, owner: str) -> dict[str, Any]:
        """A page of ``owner``'s batches, newest first. Raises APIError 400 for an unknown ``after``."""
        try:
            records = self._opened().store.list_batches(after=after, limit=limit + 1, owner=owner)
        except KeyError:
            raise bad_request(f"'after' must be the id of a batch, got {after!r}", "after") from None
        return _page([r.to_openai() for r in records], limit)

    def cancel(self, batch_id: str, owner: str) -> dict[str, Any]:
        """Start cancelling a batch (``cancelling``, then ``cancelled`` with the rows done so far).

        Raises:
            APIError: 404 for an unknown id; 409 for a batch that has finished or is finalizing.
        """
        opened = self._opened()
        record = self._batch(batch_id, owner)
        if record.status == "cancelling":
            return record.to_openai()
        if record.status not in ACTIVE_STATUSES or record.status == "finalizing":
            raise APIError(409, f"cannot cancel batch {batch_id}: its status is {record.status!r} "
                                "(only a validating or in_progress batch can be cancelled)",
                           "invalid_request_error", None, "batch_not_cancellable")
        opened.store.update_batch(batch_id, status="cancelling", cancelling_at=int(time.time()))
        opened.runner.launch(batch_id)  # a new task when none runs (engine down): it finishes the cancel
        opened.runner.stop(batch_id)
        return self._batch(batch_id, owner).to_openai()

    def _batch(self, batch_id: str, owner: str) -> BatchRecord:
        record = self._opened().store.get_batch(batch_id, owner)
        if record is None:
            raise not_found("batch", batch_id)
        return record


def _page(objects: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """OpenAI's list object from up to ``limit + 1`` objects (the extra one only sets ``has_more``)."""
    data = objects[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(objects) > limit}


def _check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's metadata rules: at most 16 pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return
    if len(metadata) > 16:
        raise bad_request(f"metadata has {len(metadata)} keys; at most 16 are allowed", "metadata")
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise bad_request(f"metadata key {key[:64]!r}: keys are at most 64 characters, values at most 512",
                              "metadata")
