"""Batches on an app whose engine never starts: expiry and cancel still finish them; one data directory
per server (a second app on the same one answers batch calls with 503)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from mm_serve.config import load_config
from mm_serve.engine.engine_holder import EngineHolder
from mm_serve.pipeline.context import ServerContext
from mm_serve.server.app import build_app
from tests.batch.helpers import jsonl, row

ROWS = [row(f"r{i}", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        for i in range(3)]


def _app(model: Path, data_dir: Path) -> TestClient:
    cfg = load_config(None, {"model": str(model), "batch.data_dir": str(data_dir), "batch.completion_window_s": 1})
    ctx = ServerContext(holder=EngineHolder(model, cfg), config=cfg, served_model_name="tiny")
    return TestClient(build_app(ctx, start_engine=False))


@pytest.fixture
def app(tiny_llava: Path, tmp_path: Path) -> Iterator[TestClient]:
    with _app(tiny_llava, tmp_path / "data") as client:  # one event loop for the batch tasks
        yield client


def _create(app: TestClient) -> dict:
    file_id = app.post("/v1/files", files={"file": ("in.jsonl", jsonl(ROWS))}, data={"purpose": "batch"}).json()["id"]
    r = app.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                      "completion_window": "24h"})
    assert r.status_code == 200, r.text
    return r.json()


def _wait(app: TestClient, batch_id: str, status: str) -> dict:
    for _ in range(100):
        batch = app.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] == status:
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} is {batch['status']}, not {status}")


def test_rows_not_done_by_the_window_expire_into_the_error_file(app: TestClient) -> None:
    batch = _create(app)
    assert batch["expires_at"] - batch["created_at"] == 1
    expired = _wait(app, batch["id"], "expired")
    assert expired["expired_at"] and expired["output_file_id"] is None
    assert expired["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    lines = app.get(f"/v1/files/{expired['error_file_id']}/content").text.splitlines()
    assert [line.count('"batch_expired"') for line in lines] == [1, 1, 1]
    assert [r["custom_id"] for r in map(json.loads, lines)] == ["r0", "r1", "r2"]


def test_a_cancel_finishes_without_an_engine(app: TestClient) -> None:
    batch = _create(app)
    in_use = app.delete(f"/v1/files/{batch['input_file_id']}")
    assert in_use.status_code == 409 and in_use.json()["error"]["code"] == "file_in_use"
    cancelling = app.post(f"/v1/batches/{batch['id']}/cancel").json()
    assert cancelling["status"] in ("cancelling", "cancelled")
    cancelled = _wait(app, batch["id"], "cancelled")
    assert cancelled["output_file_id"] is None and cancelled["error_file_id"] is None
    assert app.delete(f"/v1/files/{batch['input_file_id']}").status_code == 200  # finished: its input may go


def test_a_second_server_on_the_same_data_directory_is_refused(app: TestClient, tiny_llava: Path,
                                                               tmp_path: Path) -> None:
    assert app.get("/v1/files").status_code == 200  # the first app holds the directory
    with _app(tiny_llava, tmp_path / "data") as second:
        r = second.get("/v1/batches")
        assert r.status_code == 503 and "in use by another mm-serve process" in r.json()["error"]["message"]
        assert second.get("/v1/models").status_code == 200



def _context(model: Path, data_dir: Path) -> ServerContext:
    cfg = load_config(None, {"model": str(model), "batch.data_dir": str(data_dir)})
    return ServerContext(holder=EngineHolder(model, cfg), config=cfg, served_model_name="tiny")


def test_a_second_server_takes_the_directory_over_once_the_first_lets_it_go(
        tiny_llava: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch call tries the lock again (no restart needed); a server that found a database at start-up
    tries it every LOCK_RETRY_S seconds, so that the batches there resume without waiting for a call."""
    from mm_serve.batch import service

    data = tmp_path / "data"
    with _app(tiny_llava, data) as first, _app(tiny_llava, data) as second:
        assert first.get("/v1/files").status_code == 200  # the first opens and holds the directory
        refused = second.get("/v1/files")
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        first.__exit__(None, None, None)  # the first server stops and lets the directory go
        assert second.get("/v1/files").status_code == 200  # this call takes it over

    monkeypatch.setattr(service, "LOCK_RETRY_S", 0.05)

    async def start_while_held() -> None:
        holder = service.BatchService(_context(tiny_llava, data))
        holder.start()  # a database is there: opened at start-up
        later = service.BatchService(_context(tiny_llava, data))
        later.start()
        try:
            await asyncio.sleep(0.2)
            assert later._open is None  # still held
            await holder.close()
            for _ in range(100):
                if later._open is not None:
                    break
                await asyncio.sleep(0.02)
            assert later._open is not None, "the second server never took the directory over"
        finally:
            await holder.close()
            await later.close()

    asyncio.run(start_while_held())
