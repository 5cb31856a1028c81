"""The batch database on its own: records, OpenAI's list order and pages, one-transaction finish."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mm_serve.batch.records import BatchRecord, FileRecord, new_batch_id, new_file_id
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
