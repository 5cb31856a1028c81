"""INPUT readers: folder ids, JSONL rows, OpenAI batch rows, and the errors they raise."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mm_serve.caption.inputs import InputError, _rows, read_inputs


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _batch_row(custom_id: str, **overrides: object) -> dict:
    row: dict[str, object] = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
           "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
    row.update(overrides)
    return row


def test_folder_is_recursive_sorted_and_filtered(tmp_path: Path) -> None:
    for rel in ("b.PNG", "a/x.jpeg", "a/y.webp", "c.tif", "notes.txt", "a/z.gif", "d.bmp", "e.jpg"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    found = read_inputs(tmp_path, "Describe.")
    assert found.format == "folder"
    assert [i.id for i in found.items] == ["a/x.jpeg", "a/y.webp", "a/z.gif", "b.PNG", "c.tif", "d.bmp", "e.jpg"]
    first = found.items[0]
    assert first.path == os.path.abspath(tmp_path / "a/x.jpeg") and first.prompt == "Describe." and first.body is None


def test_jsonl_rows_relative_paths_prompts_and_int_ids(tmp_path: Path) -> None:
    source = _write_jsonl(tmp_path / "in.jsonl", [
        {"id": "one", "image": "imgs/1.png"},
        {"id": 2, "image": "/abs/2.png", "prompt": "What is in this picture?"},
        {"id": "three", "image": "data:image/png;base64,AAAA"},
    ])
    found = read_inputs(source, "Describe the image.")
    assert found.format == "jsonl"
    one, two, three = found.items
    assert one.path == os.path.abspath(tmp_path / "imgs/1.png") and one.prompt == "Describe the image."
    assert two.id == "2" and two.path == "/abs/2.png" and two.prompt == "What is in this picture?"
    assert three.path is None and three.image == "data:image/png;base64,AAAA"


@pytest.mark.parametrize(("rows", "message"), [
    ([{"id": "a", "image": "x.png"}, {"id": "a", "image": "y.png"}], "in.jsonl:2: duplicate id 'a' (first on line 1)"),
    ([{"image": "x.png"}], "'id' must be a non-empty string or an integer"),
    ([{**_batch_row("a"), "custom_id": 5}], "'custom_id' must be a non-empty string, got 5"),  # OpenAI: a string
    ([{"id": "a"}], "'image' must be a file path or a data: URI"),
    ([{"id": "a", "image": "x.png", "prompt": ""}], "'prompt' must be a non-empty string"),
    ([{"id": "a", "image": "http://example.com/x.png"}], "in.jsonl:1: 'image' is a URL (http://...); a JSONL row takes"),
    ([{"id": "a", "video": "HTTPS://example.com/x.mp4"}], "'video' is a URL (HTTPS://...)"),
    ([{"id": "a", "image": "x.png"}, _batch_row("b")], "an OpenAI batch row in a file"),
    ([_batch_row("a"), _batch_row("a")], "duplicate id 'a'"),
    ([_batch_row("a", url="/v1/embeddings")], "only POST /v1/chat/completions rows are supported"),
    ([_batch_row("a", body={"model": "m"})], "'body' must be a chat-completion request with 'messages'"),
])
def test_bad_rows_name_file_and_line(tmp_path: Path, rows: list[dict], message: str) -> None:
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_inputs(_write_jsonl(tmp_path / "in.jsonl", rows), "p")


def test_batch_rows_keep_their_body(tmp_path: Path) -> None:
    found = read_inputs(_write_jsonl(tmp_path / "b.jsonl", [_batch_row("r1"), _batch_row("r2")]), "p")
    assert found.format == "openai-batch"
    assert [i.id for i in found.items] == ["r1", "r2"]
    assert found.items[0].body == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert found.items[0].image is None and found.items[0].prompt is None


def test_missing_empty_and_non_json_inputs(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file or folder"):
        read_inputs(tmp_path / "nope", "p")
    os.mkfifo(tmp_path / "rows.fifo")
    for device in ("/dev/zero", str(tmp_path / "rows.fifo")):
        with pytest.raises(InputError, match="is not a regular file"):
            read_inputs(device, "p")
    with pytest.raises(InputError, match="no images or videos found"):
        read_inputs(tmp_path, "p")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(InputError, match="no rows"):
        read_inputs(tmp_path / "empty.jsonl", "p")
    (tmp_path / "bad.jsonl").write_text('{"id": "a", "image": "x"}\n{oops\n')
    with pytest.raises(InputError, match="bad.jsonl:2: not valid JSON"):
        read_inputs(tmp_path / "bad.jsonl", "p")
    for line, why in (("[" * 100_000 + "]" * 100_000, "nested too deeply"), ('{"id": 1' + "0" * 5000 + "}", "digits")):
        (tmp_path / "bad.jsonl").write_text('{"id": "a", "image": "x"}\n' + line + "\n")
        with pytest.raises(InputError, match=f"bad.jsonl:2: not valid JSON .*{why}"):
            read_inputs(tmp_path / "bad.jsonl", "p")


def test_a_line_whose_strings_hold_unicode_line_separators_is_one_row(tmp_path: Path) -> None:
    """JSON written with ``ensure_ascii=False`` may hold U+2028 or U+0085 inside a string: lines end at
    newlines only (str.splitlines() cut such a line in two, "not valid JSON")."""
    source = tmp_path / "in.jsonl"
    rows = [{"custom_id": "a", "prompt": "one\u2028two"}, {"custom_id": "b", "prompt": "x\x85y"}]
    text = "\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\r\n"
    assert "\u2028" in text and "\x85" in text
    assert list(_rows(source, text)) == [(1, rows[0]), (2, rows[1])]


def test_a_leading_byte_order_mark_is_skipped(tmp_path: Path) -> None:
    """Windows editors start UTF-8 files with a byte-order mark: the first row still reads."""
    source = tmp_path / "bom.jsonl"
    source.write_bytes(b"\xef\xbb\xbf" + (json.dumps(_batch_row("r1")) + "\n" + json.dumps(_batch_row("r2"))).encode())
    assert [i.id for i in read_inputs(source, "p").items] == ["r1", "r2"]


def test_bytes_that_are_not_utf8_name_their_line(tmp_path: Path) -> None:
    """As the Batch API's check of the same file: the line, not the codec's byte offset."""
    source = tmp_path / "in.jsonl"
    source.write_bytes(json.dumps(_batch_row("r1")).encode() + b"\n\xff\xfe\n")
    with pytest.raises(InputError, match=r"in.jsonl:2: not UTF-8 text$"):
        read_inputs(source, "p")


def test_a_file_name_that_is_not_utf8_gets_an_id_an_output_row_can_hold(tmp_path: Path) -> None:
    """A name with a 0xFF byte: Python holds it as a lone surrogate, which the UTF-8 output writer refused
    (the job died at that row on every run); its id and path show the byte as \\xff, and the file still
    opens by its real name."""
    from mm_serve.caption.backends import read_error_message

    raw = os.fsencode(tmp_path) + b"/bad\xffname.png"
    with open(raw, "wb") as handle:
        handle.write(b"x")
    (item,) = read_inputs(tmp_path, "p").items
    assert item.id == "bad\\xffname.png" and item.path == f"{tmp_path}/bad\\xffname.png"
    assert item.image is not None and os.fsencode(item.image) == raw
    json.dumps({"id": item.id, "path": item.path}, ensure_ascii=False).encode("utf-8")  # what the writer does
    message = read_error_message(item, OSError(13, "Permission denied"))
    assert message == f"cannot read image file {tmp_path}/bad\\xffname.png: Permission denied"


@pytest.mark.parametrize(("row", "message"), [
    ({"id": "a", "image": "x.png", "promt": "Describe."}, "in.jsonl:1: unknown key(s) 'promt'; a row has id, image, prompt, video"),
    ({"id": "a", "image": "x.png", "video": "x.mp4"}, "in.jsonl:1: a row has an 'image' or a 'video', not both"),
])
def test_a_jsonl_row_with_a_key_it_does_not_take_is_a_usage_error(tmp_path: Path, row: dict, message: str) -> None:
    """A misspelt 'prompt' was left out (the row captioned with the default prompt); an 'image' beside a
    'video' was taken and the video dropped."""
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps(row) + "\n")
    with pytest.raises(InputError) as caught:
        read_inputs(source, "p")
    assert str(caught.value).endswith(message)
