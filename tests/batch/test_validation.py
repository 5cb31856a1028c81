"""An input file checked for a batch: the server's limits, each error naming the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mm_serve.batch.validation import BatchFileError, read_batch_file
from mm_serve.config import config_from_dict

CONFIG = config_from_dict({"batch": {"max_lines": 3}, "api": {"max_body_bytes": 2048}})


def _line(custom_id: str, url: str = "/v1/completions", **body: object) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"prompt": "hi", **body}})


def _read(tmp_path: Path, text: str | bytes, endpoint: str = "/v1/completions") -> list[str]:
    path = tmp_path / "in.jsonl"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return [item.id for item in read_batch_file(path, "in.jsonl", endpoint, CONFIG)]


def test_completion_rows_are_read_in_order_with_blank_lines_skipped(tmp_path: Path) -> None:
    assert _read(tmp_path, f"{_line('a')}\n\n{_line('b')}\n") == ["a", "b"]


@pytest.mark.parametrize(("text", "message"), [
    ("\n".join(_line(str(i)) for i in range(4)), "in.jsonl:4: more than batch.max_lines (3) requests"),
    (f"{_line('a')}\n{_line('b', prompt='x' * 3000)}", "in.jsonl:2: the request is 3"),
    (f"{_line('a')}\n{_line('b', url='/v1/chat/completions')}", "in.jsonl:2: only POST /v1/completions rows"),
    (f"{_line('a')}\n" + json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {}}),
     "in.jsonl:2: 'body' must be a completion request with 'prompt'"),
    ("", "in.jsonl: no rows"),
    # the first bad line is named, whatever is wrong further down (every line was parsed before any was checked)
    (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}) + '\n{"custom_id": "a"}\n'
     "not json", "in.jsonl:1: 'body' must be a completion request with 'prompt'"),
    (f"{_line('a')}\n{_line('a')}\nnot json", "in.jsonl:2: duplicate custom_id 'a' (first on line 1)"),
])
def test_each_problem_is_named_with_its_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(BatchFileError) as caught:
        _read(tmp_path, text)
    assert message in str(caught.value)


def test_bytes_that_are_not_utf8_name_their_line(tmp_path: Path) -> None:
    with pytest.raises(BatchFileError, match=r"in.jsonl:2: not UTF-8 text"):
        _read(tmp_path, _line("a").encode() + b"\n\xff\xfe\n")


def test_a_leading_byte_order_mark_is_skipped(tmp_path: Path) -> None:
    assert _read(tmp_path, b"\xef\xbb\xbf" + f"{_line('a')}\n{_line('b')}".encode()) == ["a", "b"]
    with pytest.raises(BatchFileError, match=r"in.jsonl:2: not valid JSON"):  # only at the start
        _read(tmp_path, f"{_line('a')}\n\ufeff{_line('b')}".encode())


def test_content_that_cannot_be_read_names_the_file_not_its_path(tmp_path: Path) -> None:
    missing = tmp_path / "file-abc.jsonl"
    with pytest.raises(BatchFileError) as caught:
        read_batch_file(missing, "in.jsonl", "/v1/completions", CONFIG)
    assert str(caught.value) == "in.jsonl: the content cannot be read (No such file or directory)"
