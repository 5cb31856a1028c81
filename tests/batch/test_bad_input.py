"""Bad input to the Batch API: each a 4xx in OpenAI's error JSON naming the problem; the server keeps serving."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests.api.server_process import ServerProcess
from tests.batch.conftest import API_KEY, MAX_FILE_BYTES, MAX_TOTAL_BYTES
from tests.batch.helpers import jsonl, row, scene_body

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _upload(server: ServerProcess, data: bytes, purpose: str = "batch") -> httpx.Response:
    return httpx.post(f"{server.url}/v1/files", headers=HEADERS, files={"file": ("in.jsonl", data)},
                      data={"purpose": purpose}, timeout=30)


def _create(server: ServerProcess, data: bytes | None = None, **fields: Any) -> httpx.Response:
    if data is not None:
        fields.setdefault("input_file_id", _upload(server, data).json()["id"])
    body = {"endpoint": "/v1/chat/completions", "completion_window": "24h", **fields}
    return httpx.post(f"{server.url}/v1/batches", headers=HEADERS, json=body, timeout=30)


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


GOOD = row("a", scene_body(0, max_tokens=2))


@pytest.mark.parametrize(("lines", "expected"), [
    ([GOOD, row("b", scene_body(1)), row("a", scene_body(2))], "in.jsonl:3: duplicate custom_id 'a' (first on line 1)"),
    ([GOOD, "{not json"], "in.jsonl:2: not valid JSON"),
    ([GOOD, '{"custom_id": "d", "body": ' + "[" * 100_000 + "]" * 100_000 + "}"], "in.jsonl:2: not valid JSON (nested"),
    ([GOOD, '{"custom_id": "i", "body": {"max_tokens": 1' + "0" * 5000 + "}}"], "in.jsonl:2: not valid JSON (an integer of over 4300 digits"),
    ([GOOD, row("e", {"input": "x"}, url="/v1/embeddings")], "in.jsonl:2: only POST /v1/chat/completions rows"),
    ([GOOD, GOOD | {"method": "GET", "custom_id": "g"}], "in.jsonl:2: only POST /v1/chat/completions rows"),
    ([{"method": "POST", "url": "/v1/chat/completions", "body": {}}], "in.jsonl:1: 'custom_id' must be a non-empty"),
    ([GOOD, row("c", {"prompt": "hi"})], "in.jsonl:2: 'body' must be a chat-completion request with 'messages'"),
    ([row("p", {"prompt": "x"}, url="/v1/completions")], "in.jsonl:1: only POST /v1/chat/completions rows"),
])
def test_a_bad_line_is_refused_at_creation_naming_it(batch_server: ServerProcess, lines: list[Any],
                                                     expected: str) -> None:
    data = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()
    error = _error(_create(batch_server, data), 400)
    assert expected in error["message"] and error["param"] == "input_file_id" and error["code"] == "invalid_batch_file"


def test_bad_requests_name_the_problem_and_the_server_keeps_serving(batch_server: ServerProcess) -> None:
    missing = _error(_create(batch_server, input_file_id="file-0123456789abcdef0123456789abcdef"), 404)
    assert missing["type"] == "not_found_error" and "file-0123456789abcdef" in missing["message"]
    assert missing["param"] == "input_file_id"
    assert "endpoint must be one of" in _error(_create(batch_server, jsonl([GOOD]), endpoint="/v1/embeddings"),
                                               400)["message"]
    assert "'24h'" in _error(_create(batch_server, jsonl([GOOD]), completion_window="1h"), 400)["message"]
    assert _error(_create(batch_server, jsonl([GOOD]), metadata={f"k{i}": "v" for i in range(17)}),
                  400)["param"] == "metadata"
    assert "Field required at 'input_file_id'" in _error(_create(batch_server), 400)["message"]
    assert _error(_upload(batch_server, jsonl([GOOD]), purpose="fine-tune"), 400)["param"] == "purpose"
    too_big = _error(_upload(batch_server, b"x" * (MAX_FILE_BYTES + 1)), 413)
    assert too_big["code"] == "file_too_large" and "batch.max_file_bytes" in too_big["message"]
    assert "batch.max_file_bytes" in _error(_upload(batch_server, b"x" * (MAX_FILE_BYTES + (2 << 20))),
                                            413)["message"]
    unknown = _error(httpx.get(f"{batch_server.url}/v1/batches/batch_nope", headers=HEADERS), 404)
    assert "batch_nope" in unknown["message"]
    assert _error(httpx.get(f"{batch_server.url}/v1/batches", params={"after": "batch_nope"}, headers=HEADERS),
                  400)["param"] == "after"
    assert _error(httpx.get(f"{batch_server.url}/v1/batches", params={"limit": 0}, headers=HEADERS), 400)

    done = _create(batch_server, jsonl([GOOD])).json()
    for _ in range(300):
        if httpx.get(f"{batch_server.url}/v1/batches/{done['id']}", headers=HEADERS).json()["status"] == "completed":
            break
        time.sleep(0.1)
    cancel = _error(httpx.post(f"{batch_server.url}/v1/batches/{done['id']}/cancel", headers=HEADERS), 409)
    assert "'completed'" in cancel["message"] and cancel["code"] == "batch_not_cancellable"

    assert httpx.get(f"{batch_server.url}/health").status_code == 200
    reply = httpx.post(f"{batch_server.url}/v1/chat/completions", headers=HEADERS, json=scene_body(3), timeout=30)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]


def test_uploads_past_the_disk_bound_get_413_until_files_are_deleted(batch_server: ServerProcess) -> None:
    chunk = b"x" * (MAX_FILE_BYTES - 1024)
    kept = []
    for _ in range(MAX_TOTAL_BYTES // len(chunk) + 2):
        r = _upload(batch_server, chunk)
        if r.status_code != 200:
            break
        kept.append(r.json()["id"])
    full = _error(r, 413)
    assert full["code"] == "storage_full" and "batch.max_total_bytes" in full["message"]
    for file_id in kept:
        assert httpx.delete(f"{batch_server.url}/v1/files/{file_id}", headers=HEADERS).json()["deleted"] is True
    assert _upload(batch_server, chunk).status_code == 200


def test_a_chunked_upload_past_the_spool_size_is_stored_whole(batch_server: ServerProcess) -> None:
    """A 300 KiB input file sent with chunked transfer encoding (no Content-Length; past the 256 KiB at which
    generation bodies are spooled for the parse process) is stored byte for byte, then deleted."""
    lines = [row(f"r{i}", scene_body(i % 5, max_tokens=2)) for i in range(2000)]
    data = jsonl(lines)
    while len(data) < 300 << 10:
        lines += lines
        data = jsonl([{**line, "custom_id": f"c{i}"} for i, line in enumerate(lines)])
    data = data[: data.rindex(b"\n", 0, 300 << 10) + 1]
    boundary = "b0undary"
    form = (f'--{boundary}\r\ncontent-disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\ncontent-disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            "content-type: application/jsonl\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    chunks = iter([form[i:i + 65536] for i in range(0, len(form), 65536)])  # an iterator: httpx sends it chunked
    r = httpx.post(f"{batch_server.url}/v1/files", content=chunks, timeout=30,
                   headers={**HEADERS, "content-type": f"multipart/form-data; boundary={boundary}"})
    assert r.status_code == 200, r.text[:300]
    file_id = r.json()["id"]
    assert r.json()["bytes"] == len(data) > 256 << 10
    assert httpx.get(f"{batch_server.url}/v1/files/{file_id}/content", headers=HEADERS, timeout=30).content == data
    assert httpx.delete(f"{batch_server.url}/v1/files/{file_id}", headers=HEADERS).json()["deleted"] is True


def test_a_file_whose_content_was_removed_by_hand_is_a_404_without_the_path(batch_server: ServerProcess) -> None:
    """Its record stays (``GET /v1/files/{id}`` answers); its content, deleted from ``batch.data_dir`` behind the
    server's back, is a 404 ``file_content_missing`` that shows no server path, and a
    batch on it is refused naming the file, not the path."""
    file_id = _upload(batch_server, jsonl([row("a", scene_body(0))])).json()["id"]
    stored = batch_server.log.parent / "data" / "files" / f"{file_id}.jsonl"
    assert stored.is_file()
    stored.unlink()
    assert httpx.get(f"{batch_server.url}/v1/files/{file_id}", headers=HEADERS, timeout=30).status_code == 200
    r = httpx.get(f"{batch_server.url}/v1/files/{file_id}/content", headers=HEADERS, timeout=30)
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["code"] == "file_content_missing" and error["type"] == "not_found_error"
    assert file_id in error["message"] and str(stored.parent) not in error["message"]
    r = _create(batch_server, input_file_id=file_id)
    assert r.status_code in (200, 400), r.text  # refused at creation, or failed when the runner reads it
    text = r.text if r.status_code == 400 else json.dumps(_final(batch_server, r.json()["id"]))
    assert file_id in text and str(stored.parent) not in text and "data/files" not in text


def _final(server: ServerProcess, batch_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        batch = httpx.get(f"{server.url}/v1/batches/{batch_id}", headers=HEADERS, timeout=30).json()
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} did not end")
