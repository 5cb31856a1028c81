"""The Batch API through the official ``openai`` client: files, a captioning batch, list, cancel."""

from __future__ import annotations

import time

import httpx
import openai

from mm_serve.shapes.scenes import draw_scene, scene_rng
from mm_serve.shapes.targets import caption
from tests.api.server_process import ServerProcess
from tests.batch.conftest import API_KEY, OTHER_KEY
from tests.batch.helpers import (
    broken_body,
    jsonl,
    output_rows,
    row,
    scene_body,
    upload,
    wait_final,
)

ROWS = 40


def test_a_batch_of_captions_answers_as_the_server_does_interactively(client: openai.OpenAI) -> None:
    """40 image rows and 2 broken ones: 40 output rows equal to the interactive answers, 2 error rows."""
    bodies = {f"scene-{i:02d}": scene_body(i) for i in range(ROWS)}
    not_an_image = broken_body()
    not_an_image["messages"][0]["content"][0]["image_url"]["url"] = "data:image/png;base64,aGVsbG8gd29ybGQ="
    rows = [row(cid, body) for cid, body in bodies.items()]
    rows[7:7] = [row("broken-truncated", broken_body())]
    rows[30:30] = [row("broken-not-an-image", not_an_image)]
    file_id = upload(client, jsonl(rows))
    assert client.files.retrieve(file_id).purpose == "batch"

    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "captions"})
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == ROWS + 2
    batch = wait_final(client, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (ROWS, 2)
    assert batch.metadata == {"job": "captions"} and batch.completed_at and batch.in_progress_at

    out = output_rows(client, batch.output_file_id)
    assert [r["custom_id"] for r in out] == list(bodies)  # input order, each once
    right = 0
    for r in out:
        body = bodies[r["custom_id"]]
        assert r["error"] is None and r["response"]["status_code"] == 200
        got = r["response"]["body"]["choices"][0]["message"]["content"]
        live = client.chat.completions.create(**body).choices[0].message.content
        assert got == live, r["custom_id"]
        _, objects = draw_scene(scene_rng("batch-test", 2026, int(r["custom_id"][-2:])))
        right += got.strip() == caption(objects)
    assert right >= 36, f"{right}/{ROWS} captions right"

    errors = output_rows(client, batch.error_file_id)
    assert sorted(r["custom_id"] for r in errors) == ["broken-not-an-image", "broken-truncated"]
    for r in errors:
        assert r["response"]["status_code"] == 400 and r["error"]["code"] == "invalid_image"
        assert r["response"]["body"]["error"]["type"] == "invalid_request_error"
    produced = client.files.retrieve(batch.output_file_id)
    assert produced.purpose == "batch_output" and produced.bytes > 0


def test_list_pages_newest_first_and_cancel_keeps_the_rows_done(client: openai.OpenAI) -> None:
    """``batches.list`` pages with ``after``/``limit``; a cancelled batch ends 'cancelled' with the rows it
    finished in its output file; cancelling it again is a 409."""
    text = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 48, "ignore_eos": True}
    slow = [row(f"slow-{i}", text) for i in range(400)]
    quick = [row(f"q-{i}", scene_body(i, max_tokens=1)) for i in range(2)]
    quick_ids = [client.batches.create(input_file_id=upload(client, jsonl(quick)), endpoint="/v1/chat/completions",
                                       completion_window="24h").id for _ in range(2)]
    victim = client.batches.create(input_file_id=upload(client, jsonl(slow)), endpoint="/v1/chat/completions",
                                   completion_window="24h")
    while client.batches.retrieve(victim.id).request_counts.completed < 5:
        time.sleep(0.05)
    cancelling = client.batches.cancel(victim.id)
    assert cancelling.status in ("cancelling", "cancelled")
    cancelled = wait_final(client, victim.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at and cancelled.cancelling_at
    done = cancelled.request_counts.completed
    assert cancelled.request_counts.total == 400 and 5 <= done < 400
    assert len(output_rows(client, cancelled.output_file_id)) == done
    try:
        client.batches.cancel(victim.id)
        raise AssertionError("a cancelled batch was cancelled again")
    except openai.ConflictError as exc:
        assert exc.status_code == 409 and "'cancelled'" in str(exc)

    for batch_id in quick_ids:
        assert wait_final(client, batch_id).status == "completed"
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == [victim.id, quick_ids[1]] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == quick_ids[0]
    assert [b.id for b in client.batches.list(limit=100).data][:3] == [victim.id, *reversed(quick_ids)]


def test_files_list_retrieve_delete_and_the_key(client: openai.OpenAI, batch_server: ServerProcess) -> None:
    """Files: list by purpose, delete (then 404); every batch route needs the API key."""
    file_id = upload(client, jsonl([row("a", scene_body(0))]), name="one.jsonl")
    listed = client.files.list(purpose="batch")
    assert file_id in [f.id for f in listed.data]
    assert client.files.retrieve(file_id).filename == "one.jsonl"
    deleted = client.files.delete(file_id)
    assert deleted.deleted and deleted.id == file_id
    try:
        client.files.retrieve(file_id)
        raise AssertionError("a deleted file was found")
    except openai.NotFoundError as exc:
        assert file_id in str(exc)
    for method, path in (("GET", "/v1/files"), ("GET", "/v1/batches"), ("POST", "/v1/batches"),
                         ("GET", f"/v1/files/{file_id}/content")):
        r = httpx.request(method, f"{batch_server.url}{path}", timeout=10)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_another_key_neither_sees_nor_touches_a_tenants_files_and_batches(
    client: openai.OpenAI, other_client: openai.OpenAI, batch_server: ServerProcess,
) -> None:
    """With two keys, each lists only its own files and batches; the other's ids are 404 to it (read,
    content, delete, cancel, a batch from its file, a list cursor) as unknown ids are, and its own
    batch runs and ends with output it alone can read. A key's later batch reuses the cached prefix of its
    earlier one; the other key's identical row does not (``api.cache_salt_by_api_key``)."""
    mine = upload(client, jsonl([row("a", scene_body(0)), row("b", scene_body(1))]), name="mine.jsonl")
    theirs = upload(other_client, jsonl([row("c", scene_body(2))]), name="theirs.jsonl")
    batch = client.batches.create(input_file_id=mine, endpoint="/v1/chat/completions", completion_window="24h")
    assert mine in [f.id for f in client.files.list().data] and theirs not in [f.id for f in client.files.list().data]
    assert [f.id for f in other_client.files.list().data] == [theirs]
    assert batch.id not in [b.id for b in other_client.batches.list(limit=100).data]
    attempts = {
        "file": lambda: other_client.files.retrieve(mine),
        "content": lambda: other_client.files.content(mine),
        "delete": lambda: other_client.files.delete(mine),
        "batch": lambda: other_client.batches.retrieve(batch.id),
        "cancel": lambda: other_client.batches.cancel(batch.id),
        "create": lambda: other_client.batches.create(input_file_id=mine, endpoint="/v1/chat/completions",
                                                      completion_window="24h"),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            raise AssertionError(f"{name}: another key reached the tenant's object")
        except openai.NotFoundError as exc:
            assert "no file with id" in str(exc) or "no batch with id" in str(exc), (name, exc)
    try:
        other_client.batches.list(after=batch.id)
        raise AssertionError("a list cursor of another key's batch was accepted")
    except openai.BadRequestError as exc:
        assert "'after' must be the id of a batch" in str(exc)
    done = wait_final(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 2
    assert sorted(r["custom_id"] for r in output_rows(client, done.output_file_id)) == ["a", "b"]
    assert done.output_file_id in [f.id for f in client.files.list(purpose="batch_output").data]
    try:
        other_client.files.content(done.output_file_id)
        raise AssertionError("another key read the tenant's batch output")
    except openai.NotFoundError:
        pass
    other_client.files.delete(theirs)
    stored = b"".join(p.read_bytes() for p in batch_server.log.parent.glob("data/batches.sqlite3*"))
    assert stored and API_KEY.encode() not in stored and OTHER_KEY.encode() not in stored  # fingerprints only
    # caches: a key's batches share prefix pages with each other (scene 0 again), never with another key's
    for who, expect_cached in ((client, True), (other_client, False)):
        again = who.batches.create(input_file_id=upload(who, jsonl([row("again", scene_body(0))])),
                                   endpoint="/v1/chat/completions", completion_window="24h")
        (answer,) = output_rows(who, wait_final(who, again.id).output_file_id)
        cached = answer["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert (cached > 0) == expect_cached, (who.api_key, cached)


def test_a_completions_batch_answers_as_v1_completions(client: openai.OpenAI) -> None:
    prompts = {"p-0": "USER: How many shapes? ASSISTANT:", "p-1": "The capital of France is", "p-2": "one two",
               "p-3": "three four"}
    tiers = {"p-0": {}, "p-1": {"service_tier": None}, "p-2": {"service_tier": "default"},
             "p-3": {"service_tier": "auto"}}  # absent, null, named, auto
    rows = [row(cid, {"model": "tiny", "prompt": text, "max_tokens": 8, "temperature": 0, **tiers[cid]},
                url="/v1/completions") for cid, text in prompts.items()]
    batch = client.batches.create(input_file_id=upload(client, jsonl(rows)), endpoint="/v1/completions",
                                  completion_window="24h")
    batch = wait_final(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 4
    for r in output_rows(client, batch.output_file_id):
        live = client.completions.create(model="tiny", prompt=prompts[r["custom_id"]], max_tokens=8, temperature=0)
        assert r["response"]["body"]["object"] == "text_completion"
        assert r["response"]["body"]["service_tier"] == ("default" if r["custom_id"] == "p-2" else "flex")
        assert r["response"]["body"]["choices"][0]["text"] == live.choices[0].text
