"""The output file: flushed rows, resume after a torn write, --retry-errors, refusing foreign files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mm_serve.caption.inputs import CaptionInput
from mm_serve.caption.output import OutputError, OutputFile
from mm_serve.caption.records import Outcome, batch_row, caption_row, failure


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _ok(item_id: str) -> str:
    return json.dumps({"id": item_id, "path": None, "caption": "c", "prompt_tokens": 1,
                       "completion_tokens": 1, "latency_s": 0.1})


def test_rows_are_readable_before_close(tmp_path: Path) -> None:
    out, resume = OutputFile.open(tmp_path / "sub" / "out.jsonl", "folder")
    assert resume.done == frozenset() and not resume.repaired_tail
    out.append({"id": "a", "caption": "x"})
    assert _lines(tmp_path / "sub" / "out.jsonl") == [{"id": "a", "caption": "x"}]  # flushed, not closed
    out.close()
    out.close()


def test_a_second_job_on_the_same_file_is_refused(tmp_path: Path) -> None:
    first, _ = OutputFile.open(tmp_path / "out.jsonl", "folder")
    with pytest.raises(OutputError, match="another caption job is writing this file"):
        OutputFile.open(tmp_path / "out.jsonl", "folder")
    first.close()
    second, _ = OutputFile.open(tmp_path / "out.jsonl", "folder")
    second.close()


def test_partial_last_line_is_cut_and_complete_one_kept(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text(_ok("a") + "\n" + _ok("b") + "\n" + _ok("c")[:17])
    out, resume = OutputFile.open(path, "folder")
    assert resume.done == {"a", "b"} and resume.repaired_tail
    out.append(json.loads(_ok("c")))
    out.close()
    assert [r["id"] for r in _lines(path)] == ["a", "b", "c"]
    path.write_text(_ok("a") + "\n" + _ok("b"))  # complete JSON, only the newline missing
    out, resume = OutputFile.open(path, "folder")
    out.close()
    assert resume.done == {"a", "b"} and not resume.repaired_tail
    assert path.read_text().endswith("}\n")


def test_error_rows_are_done_unless_retried(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text(_ok("a") + "\n" + json.dumps({"id": "b", "path": None, "error": "bad"}) + "\n")
    out, resume = OutputFile.open(path, "folder")
    out.close()
    assert resume.done == {"a", "b"} and resume.dropped_errors == 0
    out, resume = OutputFile.open(path, "folder", retry_errors=True)
    out.close()
    assert resume.done == {"a"} and resume.dropped_errors == 1
    assert [r["id"] for r in _lines(path)] == ["a"]


def test_corrupt_middle_line_and_foreign_rows_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text(_ok("a") + "\n\n{broken\n" + _ok("b") + "\n")
    with pytest.raises(OutputError, match="out.jsonl:3: not valid JSON"):
        OutputFile.open(path, "folder")
    path.write_text(_ok("a") + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")  # past the recursion limit
    with pytest.raises(OutputError, match="out.jsonl:2: not valid JSON"):
        OutputFile.open(path, "folder")
    path.write_text(json.dumps({"id": "batch_req_1", "custom_id": "x", "response": None, "error": None}) + "\n")
    with pytest.raises(OutputError, match="not a caption row"):
        OutputFile.open(path, "folder")
    out, resume = OutputFile.open(path, "openai-batch")
    out.close()
    assert resume.done == {"x"}
    with pytest.raises(OutputError, match="is a folder"):
        OutputFile.open(tmp_path, "folder")


def test_a_last_line_that_is_no_row_is_refused_not_cut(tmp_path: Path) -> None:
    """Only a tail that starts like a row is taken for an interrupted write: an unrelated file given as
    OUT is refused untouched."""
    path = tmp_path / "notes.txt"
    path.write_text("my only line, no newline")
    with pytest.raises(OutputError, match="notes.txt:1: not valid JSON"):
        OutputFile.open(path, "folder")
    assert path.read_text() == "my only line, no newline"
    path.write_text(_ok("a") + "\n" + '{"id": "b", "capt')
    out, resume = OutputFile.open(path, "folder")
    out.close()
    assert resume.repaired_tail and resume.done == {"a"} and path.read_text() == _ok("a") + "\n"


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_out_that_is_not_a_regular_file_is_refused(device: str) -> None:
    """A device as OUT would be read back without end (/dev/zero) or lose every row (/dev/null)."""
    with pytest.raises(OutputError, match="is not a regular file"):
        OutputFile.open(device, "folder")


def test_row_layouts() -> None:
    item = CaptionInput("a.png", "/x/a.png", "/x/a.png", "Describe.")
    ok = Outcome(latency_s=0.123456, caption="a red circle", prompt_tokens=80, completion_tokens=4, status_code=200)
    assert caption_row(item, ok) == {"id": "a.png", "path": "/x/a.png", "caption": "a red circle",
                                     "prompt_tokens": 80, "completion_tokens": 4, "latency_s": 0.1235}
    assert caption_row(item, failure(0.1, "broken")) == {"id": "a.png", "path": "/x/a.png", "error": "broken"}
    batch_item = CaptionInput("r1", None, None, None, {"messages": []})
    good = batch_row(batch_item, Outcome(latency_s=1.0, status_code=200, body={"object": "chat.completion"},
                                         request_id="chatcmpl-1"))
    assert good["id"].startswith("batch_req_") and good["custom_id"] == "r1" and good["error"] is None
    assert good["response"] == {"status_code": 200, "request_id": "chatcmpl-1", "body": {"object": "chat.completion"}}
    bad = batch_row(batch_item, failure(0.1, "nope", "invalid_image", 400, {"error": {"message": "nope"}}))
    assert bad["error"] == {"code": "invalid_image", "message": "nope"} and bad["response"]["status_code"] == 400
