"""A batch created while the server still warms up runs once the service takes calls: none of its rows
is failed with the warming 503."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai

from tests.api.server_process import ServerProcess
from tests.batch.helpers import jsonl, output_rows, row, upload, wait_final, write_config

ROWS = 40


def test_a_batch_created_while_the_server_warms_completes_every_row(tiny_llava: Path, tmp_path: Path) -> None:
    """The embedded model's placement on two cores (two prefill workers, the second niced on the decode
    worker's core): the pool counts as ready once one prefill worker and the decode worker are, well before
    the start is over and calls are taken. The batch's rows waited for the first (and got 503 "warming",
    written as 40 failed rows of 40), where they now wait for the second."""
    config = write_config(tmp_path / "config.yaml", tmp_path / "data")
    config.write_text(config.read_text() + "compute:\n  prefill_workers: 2\n  prefill_cpus: [0, 1]\n  decode_cpus: [1]\n"
                      "  prefill_worker_nice: 10\n")
    server = ServerProcess(tiny_llava, "--config", str(config), log_dir=tmp_path)
    try:
        deadline = time.monotonic() + 60
        status = 0
        while status != 503 and time.monotonic() < deadline:
            try:
                status = httpx.get(f"{server.url}/health", timeout=2).status_code
            except httpx.HTTPError:
                time.sleep(0.02)
        assert status == 503, server.output()  # warming
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 4,
                "temperature": 0, "ignore_eos": True}
        rows = [row(f"row-{i:02d}", body) for i in range(ROWS)]
        batch = client.batches.create(input_file_id=upload(client, jsonl(rows)), endpoint="/v1/chat/completions",
                                      completion_window="24h")
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503  # created before the start ended
        finished = wait_final(client, batch.id)
        assert finished.status == "completed" and finished.request_counts.completed == ROWS, finished
        assert finished.error_file_id is None
        assert [r["custom_id"] for r in output_rows(client, finished.output_file_id)] == [r["custom_id"] for r in rows]
    finally:
        assert server.stop() == 0, server.output()[-2000:]
