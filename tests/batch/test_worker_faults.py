"""Both workers of a 1P+1D server killed mid-batch, one after the other: the server restarts them and the
batch goes on by itself, every custom_id in the output exactly once, without a server restart.

While the only prefill worker restarts (seconds), no path serves; the decode worker still finishes the
rows it runs, so the rows after them start while the engine is down. They used to stop the batch's
task, leaving the batch ``in_progress`` until the next server start."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai

from tests.api.server_process import ServerProcess
from tests.batch.helpers import jsonl, output_rows, row, upload, wait_final, write_config

ROWS = 96


def _worker_pids(url: str) -> dict[str, int]:
    """``{worker name: pid}`` from ``/internal/stats``."""
    return {name: int(stats["pid"]) for name, stats in httpx.get(f"{url}/internal/stats", timeout=5).json().items()}


def _wait_restarted(url: str, old: dict[str, int], timeout_s: float = 60.0) -> None:
    """Until every worker of ``old`` runs again under a new pid and ``/health`` is ok."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            now = _worker_pids(url)
            if (all(now.get(name) not in (None, pid) for name, pid in old.items())
                    and httpx.get(f"{url}/health", timeout=5).json()["status"] == "ok"):
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"workers {sorted(old)} not restarted within {timeout_s} s")


def test_a_batch_goes_on_after_its_only_prefill_and_decode_workers_are_killed(tiny_llava: Path,
                                                                              tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml", tmp_path / "data", max_in_flight_rows=8)  # rows start all along
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 160, "min_tokens": 160,
            "temperature": 0, "ignore_eos": True}
    rows = [row(f"row-{i:03d}", body) for i in range(ROWS)]
    server = ServerProcess(tiny_llava, "--config", str(config), log_dir=tmp_path)
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
        batch = client.batches.create(input_file_id=upload(client, jsonl(rows)), endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 60
        while client.batches.retrieve(batch.id).request_counts.completed < ROWS // 8:
            assert time.monotonic() < deadline, "the batch did not start"
            time.sleep(0.02)
        workers = _worker_pids(server.url)
        prefill = next(pid for name, pid in workers.items() if name.startswith("prefill"))
        decode = next(pid for name, pid in workers.items() if name.startswith("decode"))
        os.kill(prefill, signal.SIGKILL)
        time.sleep(2.0)
        os.kill(decode, signal.SIGKILL)
        _wait_restarted(server.url, workers)
        assert client.batches.retrieve(batch.id).request_counts.completed < ROWS, "the kills came after the batch"
        finished = wait_final(client, batch.id, timeout_s=120)
        assert finished.status == "completed" and finished.request_counts.completed == ROWS
        assert finished.error_file_id is None
        out = output_rows(client, finished.output_file_id)
        assert [r["custom_id"] for r in out] == [r["custom_id"] for r in rows]  # each exactly once, input order
        texts = {r["response"]["body"]["choices"][0]["message"]["content"] for r in out}
        assert len(texts) == 1  # the same greedy answer for every row, before the kills and after
    finally:
        assert server.stop() == 0, server.output()[-2000:]
