"""Read the inputs of a caption job: an image folder, a JSONL file, or an OpenAI batch input file.

Every input gets a stable id, the key that resume matches on:

* folder (recursive, :data:`IMAGE_SUFFIXES` and :data:`VIDEO_SUFFIXES`, case-insensitive): the
  file's path relative to the folder, with ``/`` separators, e.g. ``birds/0001.jpg``; inputs
  are sorted by that id;
* JSONL rows ``{"id", "image" | "video", "prompt"?}``: the row's ``id`` (a string, or an
  integer kept as its decimal string); ``image`` (``video``) is a file path (relative paths
  are taken from the JSONL file's folder) or a ``data:image/...;base64,`` (``data:video/...``) URI;
  a video is captioned by models that take video (Qwen2-VL);
* OpenAI batch rows ``{"custom_id", "method": "POST", "url": "/v1/chat/completions",
  "body": {...}}``: the ``custom_id``; the body is sent as the request.

The format of a file is decided by its first row: a ``custom_id`` key means an
OpenAI batch file. A malformed row, a duplicate id or an empty input raises
:class:`InputError` before anything runs.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mm_serve.ground.json_text import JSONTextError, load_json

IMAGE_SUFFIXES: frozenset[str] = frozenset({".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tiff", ".tif"})
VIDEO_SUFFIXES: frozenset[str] = frozenset({".mp4", ".webm", ".mov", ".mkv", ".avi", ".m4v"})
BATCH_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
JSONL_KEYS = frozenset({"id", "image", "video", "prompt"})  # a JSONL input row's keys

InputFormat = Literal["folder", "jsonl", "openai-batch"]


class InputError(ValueError):
    """INPUT cannot be read as a caption job; the message names the file and line."""


@dataclass(frozen=True)
class CaptionInput:
    """One unit of work.

    Attributes:
        id: the stable id (folder-relative path, JSONL ``id`` or batch ``custom_id``).
        path: the image file as an absolute path, or None (data URI, batch row).
        image: what to load: a file path or a ``data:`` URI (an image, or a video: :attr:`is_video`); None for
            a batch row.
        prompt: the user text sent after the image; None for a batch row.
        body: the request body of a batch row, else None.
        url: the endpoint a batch row's body is for (:data:`BATCH_URL` or :data:`COMPLETIONS_URL`).
    """

    id: str
    path: str | None
    image: str | None
    prompt: str | None
    body: dict[str, Any] | None = None
    url: str = BATCH_URL

    @property
    def is_video(self) -> bool:
        """Whether :attr:`image` is a video (a ``data:video/`` URI or a file with a :data:`VIDEO_SUFFIXES` suffix)."""
        if self.image is None:
            return False
        if self.image[:5].lower() == "data:":
            return self.image[5:11].lower() == "video/"
        return Path(self.image).suffix.lower() in VIDEO_SUFFIXES


@dataclass(frozen=True)
class InputSet:
    """Every input of a job, in input order, and the format they came in."""

    format: InputFormat
    items: list[CaptionInput]


def read_inputs(source: str | os.PathLike[str], default_prompt: str) -> InputSet:
    """Read ``source`` (a folder or a JSONL file); ``default_prompt`` fills rows without a prompt.

    Raises:
        InputError: missing or unreadable INPUT, a malformed row, a duplicate id,
            or no inputs at all.
    """
    path = Path(source)
    if path.is_dir():
        items = _read_folder(path, default_prompt)
        if not items:
            raise InputError(f"{path}: no images or videos found ({', '.join(sorted(IMAGE_SUFFIXES | VIDEO_SUFFIXES))})")
        return InputSet("folder", items)
    if not path.is_file():
        if path.exists():  # /dev/zero, a pipe (<(cat rows.jsonl)), a socket: read without end or only once
            raise InputError(f"{path}: is not a regular file (a device or a pipe); INPUT must be a folder or a JSONL file")
        raise InputError(f"{path}: no such file or folder")
    if path.suffix.lower() in IMAGE_SUFFIXES:
        raise InputError(f"{path}: INPUT must be a folder of images or a JSONL file, not one image "
                         "(put it in a folder, or use `mm-serve generate --image` for a single image)")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc}") from None
    try:
        text = data.decode("utf-8-sig")  # a leading byte-order mark is skipped
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise InputError(f"{path}:{line}: not UTF-8 text") from None
    rows = _rows(path, text)
    first = next(rows, None)
    if first is None:
        raise InputError(f"{path}: no rows (expected JSON lines)")
    if "custom_id" in first[1]:
        fmt: InputFormat = "openai-batch"
        return InputSet(fmt, _items(path, itertools.chain([first], rows),
                                    lambda n, row: _batch_item(path, n, row, frozenset({BATCH_URL}))))
    fmt = "jsonl"
    return InputSet(fmt, _items(path, itertools.chain([first], rows),
                                lambda n, row: _jsonl_item(path, n, row, default_prompt)))


def parse_batch_rows(text: str, source: str, urls: frozenset[str]) -> list[CaptionInput]:
    """The rows of an OpenAI batch input file held in ``text``, in file order.

    Args:
        text: the file's content (JSON lines; blank lines are skipped).
        source: the name that error messages start with (``source:LINE: ...``).
        urls: the endpoints rows may name (``url``), e.g. ``{BATCH_URL}``.

    Raises:
        InputError: a line that is not a JSON object, a row without a non-empty
            ``custom_id``, a method other than POST, a ``url`` not in ``urls``, a body
            that is not a request for its ``url``, a duplicate ``custom_id``, or no rows.
    """
    path = Path(source)
    items = _items(path, _rows(path, text), lambda n, row: _batch_item(path, n, row, urls), "custom_id")
    if not items:
        raise InputError(f"{path}: no rows (expected JSON lines)")
    return items


def _read_folder(root: Path, prompt: str) -> list[CaptionInput]:
    items = []
    for file in root.rglob("*"):
        if file.suffix.lower() in IMAGE_SUFFIXES | VIDEO_SUFFIXES and file.is_file():
            rel = printable_name(file.relative_to(root).as_posix())
            items.append(CaptionInput(rel, printable_name(os.path.abspath(file)), str(file), prompt))
    return sorted(items, key=lambda item: item.id)


def printable_name(name: str) -> str:
    """A file name as text an output row can hold: the bytes of a name that are not UTF-8 (Python keeps them
    as lone surrogates, which no UTF-8 writer takes) written as ``\\xNN``; other names unchanged."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def _rows(path: Path, text: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for every non-blank line, in file order, each parsed when it is reached.

    Raises:
        InputError: a line that is not JSON (nested past Python's recursion limit, an integer of over
            4,300 digits included) or not a JSON object.
    """
    # lines end at \n only: str.splitlines() also splits at U+2028 and U+0085, which JSON strings may hold
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = load_json(line)
        except JSONTextError as exc:
            raise InputError(f"{path}:{number}: not valid JSON ({exc.reason})") from None
        if not isinstance(row, dict):
            raise InputError(f"{path}:{number}: each line must be a JSON object, got {type(row).__name__}")
        yield number, row


def _items(path: Path, rows: Iterator[tuple[int, dict[str, Any]]],
           item_of: Callable[[int, dict[str, Any]], CaptionInput], key: str = "id") -> list[CaptionInput]:
    """``item_of(line number, row)`` of each row, in file order, each line parsed and checked before the
    next, so that an error names the first bad line.

    Raises:
        InputError: as :func:`_rows` and ``item_of``; a duplicate id (``key`` names it).
    """
    first: dict[str, int] = {}
    items = []
    for number, row in rows:
        item = item_of(number, row)
        if item.id in first:
            raise InputError(f"{path}:{number}: duplicate {key} {item.id!r} (first on line {first[item.id]})")
        first[item.id] = number
        items.append(item)
    return items


def _row_id(path: Path, number: int, row: dict[str, Any], key: str, integers: bool = False) -> str:
    """Row ``number``'s ``key``: a non-empty string (or, with ``integers``, an integer), as text."""
    value = row.get(key)
    kinds = (str, int) if integers else (str,)
    if isinstance(value, bool) or not isinstance(value, kinds) or value == "":
        what = "a non-empty string or an integer" if integers else "a non-empty string"
        raise InputError(f"{path}:{number}: '{key}' must be {what}, got {value!r}")
    return str(value)


def _jsonl_item(path: Path, number: int, row: dict[str, Any], default_prompt: str) -> CaptionInput:
    if "custom_id" in row:
        raise InputError(f"{path}:{number}: an OpenAI batch row in a file whose first row is not one")
    unknown = sorted(set(row) - JSONL_KEYS)
    if unknown:  # a misspelt 'prompt' left out would caption with the default prompt
        raise InputError(f"{path}:{number}: unknown key(s) {', '.join(map(repr, unknown))}; a row has "
                         f"{', '.join(sorted(JSONL_KEYS))}")
    if "image" in row and "video" in row:
        raise InputError(f"{path}:{number}: a row has an 'image' or a 'video', not both")
    item_id = _row_id(path, number, row, "id", integers=True)
    key = "video" if "video" in row else "image"
    image = row.get(key)
    if not isinstance(image, str) or not image:
        raise InputError(f"{path}:{number}: '{key}' must be a file path or a data: URI, got {image!r}")

    prompt = row.get("prompt", default_prompt)
    if not isinstance(prompt, str) or not prompt:
        raise InputError(f"{path}:{number}: 'prompt' must be a non-empty string, got {prompt!r}")
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", image)
    if scheme is not None:
        raise InputError(f"{path}:{number}: '{key}' is a URL ({scheme.group(1)}://...); a JSONL row takes a file path "
                         "or a data: URI (download the file first)")
    if image[:5].lower() == "data:":
        item = CaptionInput(item_id, None, image, prompt)
    else:
        file = Path(image).expanduser()
        if not file.is_absolute():
            file = path.parent / file
        item = CaptionInput(item_id, os.path.abspath(file), str(file), prompt)
    if key == "video" and not item.is_video:
        raise InputError(f"{path}:{number}: 'video' must be a data:video/... URI or a file ending in one of "
                         f"{', '.join(sorted(VIDEO_SUFFIXES))}")
    return item


def _batch_item(path: Path, number: int, row: dict[str, Any], urls: frozenset[str]) -> CaptionInput:
    item_id = _row_id(path, number, row, "custom_id")
    method, url, body = row.get("method", "POST"), row.get("url"), row.get("body")
    if method != "POST" or url not in urls:
        allowed = " or ".join(sorted(urls))
        raise InputError(f"{path}:{number}: only POST {allowed} rows are supported, got {method!r} {url!r}")
    if url == COMPLETIONS_URL:
        if not isinstance(body, dict) or "prompt" not in body:
            raise InputError(f"{path}:{number}: 'body' must be a completion request with 'prompt'")
    elif not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        raise InputError(f"{path}:{number}: 'body' must be a chat-completion request with 'messages'")
    return CaptionInput(item_id, None, None, None, body, str(url))
