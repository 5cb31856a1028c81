"""File contents under ``batch.data_dir``: uploads, output files, running batches' results; the disk bound.

Layout::

    DATA_DIR/batches.sqlite3           the records (mm_serve.batch.store)
    DATA_DIR/files/<file id>.jsonl     uploaded and produced files
    DATA_DIR/results/<batch id>.jsonl  a running batch's result rows (removed when it finishes)

An upload is written to a hidden temporary file, fsynced and renamed into place
before its record is added, so a crash leaves either no file or a complete one
(:meth:`FileStore.sweep` removes files that have no record).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from mm_serve.batch.records import FileRecord, new_file_id
from mm_serve.batch.store import BatchStore
from mm_serve.config import BatchConfig

CHUNK_BYTES = 1 << 20


class FileLimitError(ValueError):
    """An upload refused by ``batch.max_file_bytes`` or ``batch.max_total_bytes``; ``code`` says which."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class FileStore:
    """Stores file contents for the records of ``store``; ``root`` is ``batch.data_dir``."""

    def __init__(self, root: Path, store: BatchStore, config: BatchConfig) -> None:
        self.root = root
        self.store = store
        self.config = config
        self.files_dir = root / "files"
        self.results_dir = root / "results"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # one upload at a time is checked against the disk bound

    def path(self, file_id: str) -> Path:
        """Where the content of ``file_id`` is (ids are ``file-`` + hex: no path tricks)."""
        return self.files_dir / f"{file_id}.jsonl"

    def results_path(self, batch_id: str) -> Path:
        """The results file of a running batch."""
        return self.results_dir / f"{batch_id}.jsonl"

    def used_bytes(self) -> int:
        """Bytes counted against ``batch.max_total_bytes``: stored files plus results files."""
        results = sum(p.stat().st_size for p in self.results_dir.glob("*.jsonl") if p.is_file())
        return self.store.stored_bytes() + results

    def save_upload(self, source: BinaryIO, filename: str, purpose: str = "batch", owner: str = "") -> FileRecord:
        """Copy ``source`` (read to its end, in 1 MiB chunks) into a new file and record it as ``owner``'s.

        Raises:
            FileLimitError: the content is over ``batch.max_file_bytes`` (code
                ``file_too_large``) or would take the stored bytes over
                ``batch.max_total_bytes`` (code ``storage_full``); nothing is kept.
            OSError: the disk refused the write.
        """
        with self._lock:
            room = self.config.max_total_bytes - self.used_bytes()
            return self._write(new_file_id(), iter(lambda: source.read(CHUNK_BYTES), b""), filename, purpose, room,
                               owner)

    def write_output(self, lines: Iterable[bytes], filename: str, owner: str = "") -> FileRecord:
        """Write ``lines`` (each ending in a newline) as a new output file of ``owner``; the caller records it.

        The record is added by :meth:`BatchStore.finish_batch` in the same transaction
        that finishes the batch; a crash before that leaves a file without a record,
        which :meth:`sweep` removes. Output files are not held to the disk bound (the
        batch has already run).
        """
        return self._write(new_file_id(), lines, filename, "batch_output", None, owner)

    def delete(self, file_id: str) -> bool:
        """Remove the content and record of ``file_id``; False when there was no record."""
        existed = self.store.delete_file(file_id)
        self.path(file_id).unlink(missing_ok=True)
        return existed

    def sweep(self, active_batches: set[str]) -> None:
        """Remove contents without a record, results files of batches not running, temporary files."""
        for path in self.files_dir.iterdir():
            if path.name.startswith(".") or self.store.get_file(path.stem) is None:
                path.unlink(missing_ok=True)
        for path in self.results_dir.iterdir():
            if path.stem not in active_batches:
                path.unlink(missing_ok=True)

    def _write(self, file_id: str, chunks: Iterable[bytes], filename: str, purpose: str,
               room: int | None, owner: str) -> FileRecord:
        """Write ``chunks`` to a temporary file, check the limits as it grows, fsync, rename, record."""
        target = self.path(file_id)
        temp = target.with_name(f".{target.name}.part")
        size = 0
        try:
            with open(temp, "wb") as out:
                for chunk in chunks:
                    size += len(chunk)
                    if purpose == "batch":
                        self._check(size, room)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, target)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        record = FileRecord(id=file_id, purpose=purpose, filename=filename, bytes=size, created_at=int(time.time()),
                            owner=owner)
        if purpose == "batch":
            self.store.add_file(record)
        return record

    def _check(self, size: int, room: int | None) -> None:
        limit = self.config.max_file_bytes
        if size > limit:
            raise FileLimitError(f"the file is larger than batch.max_file_bytes ({limit} bytes)", "file_too_large")
        if room is not None and size > room:
            raise FileLimitError(
                f"no room for this file: stored files would take more than batch.max_total_bytes "
                f"({self.config.max_total_bytes} bytes); delete files (DELETE /v1/files/{{id}}) to make room",
                "storage_full")
