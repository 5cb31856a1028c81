"""Batch input rows, a YAML config for a test server, and polling a batch to its end."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import openai
import yaml

from mm_serve.shapes.scenes import draw_scene, scene_rng
from tests.api.server_process import data_uri

FINAL = ("completed", "failed", "expired", "cancelled")
BROKEN_PNG = "data:image/png;base64," + "iVBORw0KGgoAAAANSUhEUgAA" * 4  # a PNG header, then nothing


def scene_body(index: int, seed: str = "batch-test", **sampling: Any) -> dict[str, Any]:
    """A caption request for drawn scene ``index`` (greedy, 24 tokens unless ``sampling`` says otherwise)."""
    image, _ = draw_scene(scene_rng(seed, 2026, index))
    return {"model": "tiny", "max_tokens": 24, "temperature": 0, **sampling, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(image)}}, {"type": "text", "text": "Describe the image."}]}]}


def broken_body() -> dict[str, Any]:
    """A caption request whose image does not decode."""
    return {"model": "tiny", "max_tokens": 24, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": BROKEN_PNG}}, {"type": "text", "text": "Describe the image."}]}]}


def row(custom_id: str, body: dict[str, Any], url: str = "/v1/chat/completions") -> dict[str, Any]:
    """One line of a batch input file."""
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    """Rows as a JSONL file's bytes."""
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def upload(client: openai.OpenAI, data: bytes, name: str = "requests.jsonl") -> str:
    """``files.create`` (purpose batch); the file id."""
    return client.files.create(file=(name, io.BytesIO(data)), purpose="batch").id


def wait_final(client: openai.OpenAI, batch_id: str, timeout_s: float = 120.0) -> Any:
    """Poll ``batches.retrieve`` until the batch reaches a final status; the batch."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in FINAL:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} not finished after {timeout_s} s: {batch}")


def output_rows(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    """The rows of an output or error file (none for a None id)."""
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


def write_config(path: Path, data_dir: Path, **batch: Any) -> Path:
    """A service config with ``batch.data_dir`` (and other ``batch`` keys) for a test server."""
    path.write_text(yaml.safe_dump({"batch": {"data_dir": str(data_dir), **batch}}))
    return path
