"""The batch database on its own: records, OpenAI's list order and pages, one-transaction finish."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from mm_serve.batch.records import BatchRecord, FileRecord, new_batch_id, new_file_id, owner_of
from mm_serve.batch.store import BatchStore


def _batch(batch_id: str, status: str = "validating") -> BatchRecord:
    return BatchRecord(id=batch_id, input_file_id="file-in", endpoint="/v1/chat/completions",
                       completion_window="24h", status=status, created_at=100, expires_at=100 + 86_400,  # type: ignore[arg-type]
                       metadata={"k": "v"}, total=3)


def test_ids_are_random_and_shaped_like_openais() -> None:
    ids = {new_file_id() for _ in range(100)} | {new_batch_id() for _ in range(100)}
    assert len(ids) == 200
    assert all(re.fullmatch(r"(file-|batch_)[0-9a-f]{32}", i) for i in ids)


def test_batches_list_newest_first_in_pages_and_survive_a_reopen(tmp_path: Path) -> None:
    store = BatchStore(tmp_path / "b.sqlite3")
    for name in ("b1", "b2", "b3", "b4"):
        store.add_batch(_batch(name, "completed" if name == "b2" else "in_progress"))
    assert [b.id for b in store.list_batches(after=None, limit=3)] == ["b4", "b3", "b2"]
    assert [b.id for b in store.list_batches(after="b3", limit=10)] == ["b2", "b1"]
    with pytest.raises(KeyError):
        store.list_batches(after="nope", limit=1)
    store.update_batch("b1", completed=2, failed=1, errors=[{"code": "x", "line": 3}])
    store.close()
    again = BatchStore(tmp_path / "b.sqlite3")
    b1 = again.get_batch("b1")
    assert b1 is not None and (b1.completed, b1.failed, b1.errors, b1.metadata) == (2, 1, [{"code": "x", "line": 3}],
                                                                                    {"k": "v"})
    assert [b.id for b in again.active_batches()] == ["b1", "b3", "b4"]
    assert again.batches_reading("file-in") == ["b1", "b3", "b4"]
    with pytest.raises(ValueError, match="not batch columns"):
        again.update_batch("b1", nonsense=1)
    again.close()


def test_finish_records_the_output_files_and_the_status_together(tmp_path: Path) -> None:
    store = BatchStore(tmp_path / "b.sqlite3")
    store.add_batch(_batch("b1", "finalizing"))
    out = FileRecord(id="file-out", purpose="batch_output", filename="b1_output.jsonl", bytes=10, created_at=5)
    with pytest.raises(ValueError):  # a bad column: neither the file nor the status is recorded
        store.finish_batch("b1", [out], status="completed", bogus=1)
    assert store.get_file("file-out") is None
    store.finish_batch("b1", [out], status="completed", completed_at=7, output_file_id="file-out")
    done = store.get_batch("b1")
    assert done is not None and (done.status, done.completed_at, done.output_file_id) == ("completed", 7, "file-out")
    assert store.get_file("file-out") == out and store.stored_bytes() == 10
    assert store.active_batches() == []
    store.add_file(FileRecord(id="file-a", purpose="batch", filename="a.jsonl", bytes=1, created_at=9))
    assert [f.id for f in store.list_files(purpose="batch", after=None, limit=5, newest_first=True)] == ["file-a"]
    assert [f.id for f in store.list_files(purpose=None, after="file-out", limit=5, newest_first=False)] == ["file-a"]
    assert store.delete_file("file-a") and not store.delete_file("file-a")
    store.close()


def test_each_owner_sees_its_own_records_and_the_ownerless_ones(tmp_path: Path) -> None:
    """A lookup or list with an owner sees that owner's records and those without one; no owner sees
    all. A page cursor of another owner's record is unknown to this one."""
    alice, bob = owner_of("sk-alice"), owner_of("sk-bob")
    assert len(alice) == 32 and alice != bob and owner_of(None) == owner_of("") == ""
    store = BatchStore(tmp_path / "b.sqlite3")
    for name, owner in (("b1", alice), ("b2", bob), ("b3", ""), ("b4", alice)):
        store.add_batch(dataclasses.replace(_batch(name), owner=owner))
        store.add_file(FileRecord(id=f"file-{name}", purpose="batch", filename=f"{name}.jsonl", bytes=1,
                                  created_at=1, owner=owner))
    assert [b.id for b in store.list_batches(after=None, limit=10, owner=alice)] == ["b4", "b3", "b1"]
    assert [b.id for b in store.list_batches(after="b4", limit=10, owner=alice)] == ["b3", "b1"]
    assert [b.id for b in store.list_batches(after=None, limit=10, owner=bob)] == ["b3", "b2"]
    assert [b.id for b in store.list_batches(after=None, limit=10)] == ["b4", "b3", "b2", "b1"]
    with pytest.raises(KeyError):
        store.list_batches(after="b1", limit=10, owner=bob)
    assert [f.id for f in store.list_files(purpose=None, after=None, limit=10, newest_first=False, owner=bob)] == [
        "file-b2", "file-b3"]
    with pytest.raises(KeyError):
        store.list_files(purpose=None, after="file-b4", limit=10, newest_first=False, owner=bob)
    assert store.get_batch("b1", bob) is None and store.get_file("file-b1", bob) is None
    b1 = store.get_batch("b1", alice)
    assert b1 is not None and b1.owner == alice and store.get_batch("b1") == b1
    assert store.get_file("file-b3", bob) is not None  # ownerless: every key's
    store.close()


def test_a_database_of_a_newer_version_is_refused(tmp_path: Path) -> None:
    """A database a newer mm-serve wrote is not opened (nor stamped down), naming both versions."""
    import sqlite3

    path = tmp_path / "new.sqlite3"
    sqlite3.connect(path).execute("PRAGMA user_version=3").connection.close()
    with pytest.raises(sqlite3.DatabaseError, match="batch database version 3; this one reads up to 2"):
        BatchStore(path)
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 3


def test_a_database_from_before_owners_opens_with_ownerless_records(tmp_path: Path) -> None:
    """A version-1 database (no owner columns) gains them on open; its records belong to no owner, so
    every key still sees them, and new records keep their owner."""
    import sqlite3

    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE files (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, purpose TEXT NOT NULL,
            filename TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
        CREATE TABLE batches (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
            input_file_id TEXT NOT NULL, endpoint TEXT NOT NULL, completion_window TEXT NOT NULL,
            status TEXT NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, model TEXT,
            metadata TEXT, errors TEXT, output_file_id TEXT, error_file_id TEXT,
            total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
            in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
            expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER);
        INSERT INTO files (id, purpose, filename, bytes, created_at) VALUES ('file-old', 'batch', 'old.jsonl', 3, 1);
        INSERT INTO batches (id, input_file_id, endpoint, completion_window, status, created_at, expires_at)
            VALUES ('batch_old', 'file-old', '/v1/chat/completions', '24h', 'completed', 1, 2);
        PRAGMA user_version=1;
    """)
    db.close()
    store = BatchStore(path)
    alice = owner_of("sk-alice")
    old = store.get_batch("batch_old", alice)
    assert old is not None and old.owner == "" and old.status == "completed"
    assert store.get_file("file-old", alice) == FileRecord(id="file-old", purpose="batch", filename="old.jsonl",
                                                            bytes=3, created_at=1)
    store.add_batch(dataclasses.replace(_batch("b-new"), owner=alice))
    assert [b.id for b in store.list_batches(after=None, limit=5, owner=owner_of("sk-bob"))] == ["batch_old"]
    store.close()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 2
