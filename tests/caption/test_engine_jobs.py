"""Jobs on the in-process engine (random tiny model): --retry-errors and the OpenAI batch round trip."""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

from mm_serve.caption.engine_backend import EngineBackend
from tests.caption.local_job import run_job
from tests.caption.scene_folder import BROKEN, write_scene_folder


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _chat(custom_id: str, content: object, **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": content}], **body}}


def _image_chat(custom_id: str, uri: str, **body: object) -> dict:
    content = [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "Describe the image."}]
    return _chat(custom_id, content, **body)


def test_retry_errors_reruns_only_error_rows(tiny_engine: EngineBackend, tmp_path: Path) -> None:
    root = tmp_path / "in"
    write_scene_folder(root, 6)
    out = tmp_path / "out.jsonl"
    first = run_job(tiny_engine, root, out)
    assert (first.succeeded, first.failed) == (6, 3)
    again = run_job(tiny_engine, root, out)
    assert (again.skipped, again.finished) == (9, 0)
    (root / BROKEN[0]).write_bytes((root / "even/scene000.png").read_bytes())  # repair one broken file
    retried = run_job(tiny_engine, root, out, retry_errors=True)
    assert (retried.skipped, retried.succeeded, retried.failed) == (6, 1, 2)
    rows = _rows(out)
    assert len(rows) == 9 and set(Counter(r["id"] for r in rows).values()) == {1}
    fixed = next(r for r in rows if r["id"] == BROKEN[0])
    assert fixed["caption"] == next(r for r in rows if r["id"] == "even/scene000.png")["caption"]
    assert sorted(r["id"] for r in rows if "error" in r) == sorted(BROKEN[1:])


def test_openai_batch_round_trip_in_process(tiny_engine: EngineBackend, tmp_path: Path) -> None:
    root = tmp_path / "in"
    write_scene_folder(root, 3)
    folder_out = tmp_path / "captions.jsonl"
    run_job(tiny_engine, root, folder_out, in_order=True)
    captions = {r["id"]: r["caption"] for r in _rows(folder_out) if "caption" in r}
    scenes = sorted(captions)
    rows = [_image_chat(f"scene-{k}", _uri(root / rel), max_tokens=8, temperature=0) for k, rel in enumerate(scenes)]
    rows += [
        _image_chat("broken", _uri(root / BROKEN[1]), max_tokens=8),
        _image_chat("too-long", _uri(root / scenes[0]), max_tokens=100_000),
        _chat("text-n2", "Hello there", max_tokens=4, n=2, seed=7, logprobs=True, top_logprobs=2),
        {"custom_id": "bad-body", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "robot", "content": "hi"}]}},
    ]
    source = tmp_path / "batch.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in reversed(rows)))
    out = tmp_path / "batch_out.jsonl"
    stats = run_job(tiny_engine, source, out)
    assert (stats.succeeded, stats.failed) == (4, 3)
    got = {r["custom_id"]: r for r in _rows(out)}
    assert sorted(got) == sorted(r["custom_id"] for r in rows)
    for k, rel in enumerate(scenes):
        row = got[f"scene-{k}"]
        assert row["id"].startswith("batch_req_") and row["error"] is None
        body = row["response"]["body"]
        assert row["response"]["status_code"] == 200 and row["response"]["request_id"] == body["id"]
        assert body["object"] == "chat.completion" and body["model"] == "tiny"
        assert body["choices"][0]["message"]["content"].strip() == captions[rel]  # same greedy answer
        assert body["usage"]["completion_tokens"] == 8
    assert got["broken"]["error"]["code"] == "invalid_image" and got["broken"]["response"]["status_code"] == 400
    assert got["too-long"]["error"]["code"] == "context_length_exceeded"
    assert got["bad-body"]["response"]["status_code"] == 400 and "role" in got["bad-body"]["error"]["message"]
    two = got["text-n2"]["response"]["body"]
    assert len(two["choices"]) == 2 and two["usage"]["completion_tokens"] == 8
    assert len(two["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
