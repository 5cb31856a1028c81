"""An uploaded input file read and checked line by line for a batch (at creation, and again on resume).

The rows are parsed by the caption job's OpenAI batch reader
(:func:`mm_serve.caption.inputs.parse_batch_rows`); here the server's own limits
are added: at most ``batch.max_lines`` requests, no line longer than
``api.max_body_bytes`` (the server would refuse that body with 413), and every
row's ``url`` equal to the batch's ``endpoint``.
"""

from __future__ import annotations

from pathlib import Path

from mm_serve.caption.inputs import CaptionInput, InputError, parse_batch_rows
from mm_serve.config import ServiceConfig


class BatchFileError(ValueError):
    """The input file cannot be run as a batch; the message names the file and line."""


def read_batch_file(path: Path, name: str, endpoint: str, config: ServiceConfig) -> list[CaptionInput]:
    """The rows of the input file at ``path`` for a batch on ``endpoint``, in file order.

    Args:
        path: where the content is stored.
        name: the file's name for messages (``name:LINE: ...``).
        endpoint: the batch's endpoint; each row's ``url`` must equal it.
        config: the service config (``batch.max_lines``, ``api.max_body_bytes``).

    Raises:
        BatchFileError: not UTF-8 (a leading byte-order mark is allowed), too many lines, a line over ``api.max_body_bytes``,
            or any row error of :func:`~mm_serve.caption.inputs.parse_batch_rows`
            (not JSON, no ``custom_id``, wrong method or url, bad body, duplicate ``custom_id``).
            Also when its content cannot be read (removed from ``batch.data_dir`` by hand): the
            message names the file, not the server's path.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BatchFileError(f"{name}: the content cannot be read ({exc.strerror or type(exc).__name__})") from None
    _check_sizes(data, name, config)
    try:
        text = data.decode("utf-8-sig")  # a leading byte-order mark (Windows editors write one) is skipped
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise BatchFileError(f"{name}:{line}: not UTF-8 text") from None
    try:
        return parse_batch_rows(text, name, frozenset({endpoint}))
    except InputError as exc:
        raise BatchFileError(str(exc)) from None


def _check_sizes(data: bytes, name: str, config: ServiceConfig) -> None:
    """Refuse more than ``batch.max_lines`` non-blank lines or a line over ``api.max_body_bytes``."""
    max_lines, max_line = config.batch.max_lines, config.api.max_body_bytes
    count = 0
    for number, line in enumerate(data.split(b"\n"), start=1):
        if len(line) > max_line:
            raise BatchFileError(f"{name}:{number}: the request is {len(line)} bytes, more than "
                                 f"api.max_body_bytes ({max_line})")
        if line.strip():
            count += 1
            if count > max_lines:
                raise BatchFileError(f"{name}:{number}: more than batch.max_lines ({max_lines}) requests in one file")
