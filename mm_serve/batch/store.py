"""The batch database: file and batch records in SQLite (the standard library's ``sqlite3``).

SQLite is enough here: one server process writes, records are small, and every
change is one transaction. The database runs in WAL mode with
``synchronous=NORMAL``: a committed change survives a crash or SIGKILL of the
server (it is in the WAL file); a power loss can lose the last commits but never
leaves the database inconsistent. Result rows themselves are not in the database:
they live in each batch's results file (:mod:`mm_serve.caption.output`), the
source of truth on resume; the counts here are refreshed from it.

Every record has an owner (:func:`mm_serve.batch.records.owner_of`). A lookup or list given an
``owner`` sees that owner's records and those without one (made by a call without a key, or
before records had owners); given "" or None, it sees every record.

All methods are thread-safe (one connection behind a lock) and raise
``sqlite3.Error`` only for a broken database or disk.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mm_serve.batch.records import ACTIVE_STATUSES, BatchRecord, FileRecord

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    owner TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    input_file_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    model TEXT,
    metadata TEXT,
    errors TEXT,
    output_file_id TEXT,
    error_file_id TEXT,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    owner TEXT NOT NULL DEFAULT ''
);
"""
_JSON_COLUMNS = ("metadata", "errors")
_BATCH_COLUMNS = tuple(BatchRecord.__dataclass_fields__)
_FILE_COLUMNS = tuple(FileRecord.__dataclass_fields__)
_SCHEMA_VERSION = 2  # 2: files.owner and batches.owner


class BatchStore:
    """File and batch records in the SQLite database at ``path`` (created with its tables)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
        if version > _SCHEMA_VERSION:
            self._db.close()
            raise sqlite3.DatabaseError(f"{path} was written by a newer mm-serve (batch database version {version}; "
                                        f"this one reads up to {_SCHEMA_VERSION}): upgrade, or use another batch.data_dir")
        with self._lock, self._db:
            self._db.executescript(_SCHEMA)
            for table in ("files", "batches"):  # a version-1 database: its records have no owner
                columns = {row["name"] for row in self._db.execute(f"PRAGMA table_info({table})")}
                if "owner" not in columns:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN owner TEXT NOT NULL DEFAULT ''")
            self._db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            self._db.close()

    # -- files -----------------------------------------------------------------------------

    def add_file(self, record: FileRecord) -> None:
        """Insert (or replace, for output files written again on resume) a file record."""
        values = [getattr(record, c) for c in _FILE_COLUMNS]
        self._write(f"INSERT OR REPLACE INTO files ({', '.join(_FILE_COLUMNS)}) "
                    f"VALUES ({', '.join('?' * len(values))})", values)

    def get_file(self, file_id: str, owner: str | None = None) -> FileRecord | None:
        """The record of ``file_id``, or None (also when ``owner`` may not see it)."""
        where, args = self._visible(owner)
        rows = self._read(f"SELECT {', '.join(_FILE_COLUMNS)} FROM files {self._where(['id = ?', *where])}",
                          [file_id, *args])
        return FileRecord(**dict(rows[0])) if rows else None

    def list_files(self, *, purpose: str | None, after: str | None, limit: int, newest_first: bool,
                   owner: str | None = None) -> list[FileRecord]:
        """Up to ``limit`` files ``owner`` may see, in upload order (or newest first), after the file ``after``.

        Raises:
            KeyError: ``after`` names no file ``owner`` may see.
        """
        where, args = self._after_clause("files", after, newest_first, owner)
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        order = "DESC" if newest_first else "ASC"
        sql = (f"SELECT {', '.join(_FILE_COLUMNS)} FROM files {self._where(where)} ORDER BY seq {order} LIMIT ?")
        return [FileRecord(**dict(r)) for r in self._read(sql, [*args, limit])]

    def delete_file(self, file_id: str) -> bool:
        """Delete the record of ``file_id``; False when there was none."""
        return self._write("DELETE FROM files WHERE id = ?", [file_id]) > 0

    def stored_bytes(self) -> int:
        """Bytes of every stored file (uploads and outputs)."""
        return int(self._read("SELECT COALESCE(SUM(bytes), 0) AS n FROM files", [])[0]["n"])

    # -- batches ---------------------------------------------------------------------------

    def add_batch(self, record: BatchRecord) -> None:
        """Insert a new batch record."""
        values = [self._encode(c, getattr(record, c)) for c in _BATCH_COLUMNS]
        self._write(f"INSERT INTO batches ({', '.join(_BATCH_COLUMNS)}) "
                    f"VALUES ({', '.join('?' * len(values))})", values)

    def get_batch(self, batch_id: str, owner: str | None = None) -> BatchRecord | None:
        """The record of ``batch_id``, or None (also when ``owner`` may not see it)."""
        where, args = self._visible(owner)
        rows = self._read(f"SELECT {', '.join(_BATCH_COLUMNS)} FROM batches {self._where(['id = ?', *where])}",
                          [batch_id, *args])
        return self._batch(rows[0]) if rows else None

    def list_batches(self, *, after: str | None, limit: int, owner: str | None = None) -> list[BatchRecord]:
        """Up to ``limit`` batches ``owner`` may see, newest first, after the batch ``after`` (OpenAI's order).

        Raises:
            KeyError: ``after`` names no batch ``owner`` may see.
        """
        where, args = self._after_clause("batches", after, True, owner)
        sql = f"SELECT {', '.join(_BATCH_COLUMNS)} FROM batches {self._where(where)} ORDER BY seq DESC LIMIT ?"
        return [self._batch(r) for r in self._read(sql, [*args, limit])]

    def active_batches(self) -> list[BatchRecord]:
        """Batches not finished yet, oldest first."""
        marks = ", ".join("?" * len(ACTIVE_STATUSES))
        rows = self._read(f"SELECT {', '.join(_BATCH_COLUMNS)} FROM batches WHERE status IN ({marks}) "
                          "ORDER BY seq", list(ACTIVE_STATUSES))
        return [self._batch(r) for r in rows]

    def batches_reading(self, file_id: str) -> list[str]:
        """Ids of unfinished batches whose input file is ``file_id``."""
        marks = ", ".join("?" * len(ACTIVE_STATUSES))
        rows = self._read(f"SELECT id FROM batches WHERE input_file_id = ? AND status IN ({marks})",
                          [file_id, *ACTIVE_STATUSES])
        return [r["id"] for r in rows]

    def update_batch(self, batch_id: str, **fields: Any) -> None:
        """Set ``fields`` (column names of :class:`BatchRecord`) of ``batch_id`` in one transaction.

        Raises:
            ValueError: a name that is not a column.
        """
        sets, values = self._sets(fields)
        self._write(f"UPDATE batches SET {sets} WHERE id = ?", [*values, batch_id])

    def finish_batch(self, batch_id: str, files: Sequence[FileRecord], **fields: Any) -> None:
        """Record the output ``files`` and set ``fields`` of ``batch_id``, in one transaction.

        Raises:
            ValueError: a name in ``fields`` that is not a column.
        """
        sets, values = self._sets(fields)
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            for record in files:
                self._db.execute(f"INSERT OR REPLACE INTO files ({', '.join(_FILE_COLUMNS)}) VALUES "
                                 f"({', '.join('?' * len(_FILE_COLUMNS))})", [getattr(record, c) for c in _FILE_COLUMNS])
            self._db.execute(f"UPDATE batches SET {sets} WHERE id = ?", [*values, batch_id])

    # -- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _visible(owner: str | None) -> tuple[list[str], list[Any]]:
        """The condition for the records ``owner`` may see: its own and those without an owner."""
        return (["owner IN ('', ?)"], [owner]) if owner else ([], [])

    def _after_clause(self, table: str, after: str | None, newest_first: bool,
                      owner: str | None) -> tuple[list[str], list[Any]]:
        where, args = self._visible(owner)
        if after is None:
            return where, args
        rows = self._read(f"SELECT seq FROM {table} {self._where(['id = ?', *where])}", [after, *args])
        if not rows:
            raise KeyError(after)
        return [*where, f"seq {'<' if newest_first else '>'} ?"], [*args, rows[0]["seq"]]

    @classmethod
    def _sets(cls, fields: dict[str, Any]) -> tuple[str, list[Any]]:
        bad = [name for name in fields if name not in _BATCH_COLUMNS or name == "id"]
        if bad or not fields:
            raise ValueError(f"not batch columns: {bad or 'none given'}")
        return ", ".join(f"{name} = ?" for name in fields), [cls._encode(n, v) for n, v in fields.items()]

    @staticmethod
    def _where(conditions: list[str]) -> str:
        return f"WHERE {' AND '.join(conditions)}" if conditions else ""

    @staticmethod
    def _encode(column: str, value: Any) -> Any:
        return json.dumps(value) if column in _JSON_COLUMNS and value is not None else value

    @staticmethod
    def _batch(row: sqlite3.Row) -> BatchRecord:
        values = dict(row)
        for column in _JSON_COLUMNS:
            if values[column] is not None:
                values[column] = json.loads(values[column])
        return BatchRecord(**values)

    def _read(self, sql: str, args: Sequence[Any]) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _write(self, sql: str, args: Sequence[Any]) -> int:
        with self._lock, self._db:
            return self._db.execute(sql, args).rowcount
