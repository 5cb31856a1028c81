"""A server killed with SIGKILL mid-batch and started again on the same data directory finishes the
batch with every custom_id exactly once, and computes none of the rows it had finished again; the
batch and its output stay its API key's alone across the restart."""

from __future__ import annotations

import json
import signal
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

from mm_serve.cluster.stale_instances import SHM_DIR, process_start_time
from tests.api.server_process import ServerProcess
from tests.batch.helpers import jsonl, output_rows, row, upload, wait_final, write_config

ROWS = 120
KEY, OTHER_KEY = "key-of-tenant-a", "key-of-tenant-b"
KEYS = ("--api-key", KEY, "--api-key", OTHER_KEY)


def _finished_requests(url: str) -> float:
    """``mm_serve_requests_total`` summed over its labels but the refusals' (``finish_reason="error"``,
    the other key's 404s among them): engine requests this server finished."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("mm_serve_requests_total") and 'finish_reason="error"' not in line)


def _instance_of(pid: int) -> str:
    """The instance id of the service whose front end is ``pid`` (from its run directory's owner file)."""
    for owner in Path(tempfile.gettempdir()).glob("mmsrv-*/owner"):
        if owner.read_text().split()[0] == str(pid):
            return owner.parent.name.split("-")[1]
    raise AssertionError(f"no run directory of pid {pid}")


def _left_behind(instance: str) -> list[Path]:
    """Segments and run directories of ``instance`` that still exist."""
    return [*SHM_DIR.glob(f"mmsrv-{instance}-*"), *Path(tempfile.gettempdir()).glob(f"mmsrv-{instance}-*")]


def test_sigkill_mid_batch_then_restart_completes_each_row_exactly_once(tiny_llava: Path, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    config = write_config(tmp_path / "config.yaml", data_dir)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 16,
            "temperature": 0, "ignore_eos": True}
    rows = [row(f"row-{i:03d}", body) for i in range(ROWS)]
    instances: list[str] = []
    first = ServerProcess(tiny_llava, "--config", str(config), *KEYS, log_dir=tmp_path)
    second = None
    try:
        first.wait_ready()
        instances.append(_instance_of(first.proc.pid))
        stats = httpx.get(f"{first.url}/internal/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
        workers = [int(w["pid"]) for w in stats.json().values()]
        client = openai.OpenAI(base_url=f"{first.url}/v1", api_key=KEY, max_retries=0, timeout=30)
        batch = client.batches.create(input_file_id=upload(client, jsonl(rows)), endpoint="/v1/chat/completions",
                                      completion_window="24h")
        while client.batches.retrieve(batch.id).request_counts.completed < ROWS // 5:
            time.sleep(0.02)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        results = data_dir / "results" / f"{batch.id}.jsonl"
        lines = results.read_bytes().split(b"\n")
        done_before = {json.loads(line)["custom_id"]: json.loads(line)["id"] for line in lines[:-1]}
        assert ROWS // 5 <= len(done_before) < ROWS, "the kill came after the batch finished"

        second = ServerProcess(tiny_llava, "--config", str(config), *KEYS, log_dir=tmp_path)
        second.wait_ready()
        instances.append(_instance_of(second.proc.pid))
        client = openai.OpenAI(base_url=f"{second.url}/v1", api_key=KEY, max_retries=0, timeout=30)
        other = openai.OpenAI(base_url=f"{second.url}/v1", api_key=OTHER_KEY, max_retries=0, timeout=30)
        with pytest.raises(openai.NotFoundError):  # resumed, the batch is still its key's alone
            other.batches.retrieve(batch.id)
        finished = wait_final(client, batch.id)
        assert finished.status == "completed" and finished.request_counts.completed == ROWS
        out = output_rows(client, finished.output_file_id)
        assert [r["custom_id"] for r in out] == [r["custom_id"] for r in rows]  # each exactly once, input order
        assert finished.error_file_id is None
        with pytest.raises(openai.NotFoundError):  # the output written after the restart is the batch key's
            other.files.content(finished.output_file_id)
        assert [b.id for b in other.batches.list()] == []
        # rows finished before the kill are kept as written (same row ids), none computed again:
        # the second server ran exactly the rows that had no result
        kept = {r["custom_id"]: r["id"] for r in out if r["custom_id"] in done_before}
        assert kept == done_before
        assert _finished_requests(second.url) == ROWS - len(done_before)
        assert not results.exists()
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
            first.proc.wait()
        if second is not None:
            assert second.stop() == 0, second.output()[-2000:]
    deadline = time.monotonic() + 10
    while any(process_start_time(pid) is not None for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(process_start_time(pid) is None for pid in workers), "a worker of the killed server is left"
    assert len(instances) == 2 and not [p for i in instances for p in _left_behind(i)]
