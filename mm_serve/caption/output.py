"""The output JSONL file: append-and-flush writing, and reading it back to resume.

Each row is written with one ``write`` of ``json + "\\n"`` followed by a flush,
so a crash of this process (even SIGKILL) loses nothing already reported; with
``fsync=True`` each row is also forced to disk (survives a power loss, slower).

While a job runs it holds an exclusive ``flock`` on OUT, so a second job on the
same file is refused instead of writing ids twice.

Resume (:meth:`OutputFile.open`): a kill can leave a partial last line. Opening
cuts everything after the last newline when that tail is the start of a row (it
begins with ``{``) but not a complete JSON object; a tail that is no row's start
is checked as any other line. Every other line must be a JSON object of the job's row layout
(:mod:`mm_serve.caption.records`); anything else is an :class:`OutputError`,
never silently skipped. Ids with a success row are done; ids with only error
rows are done too, unless ``retry_errors`` is set, in which case those rows are
removed (the file is rewritten atomically) so the re-run writes each id once.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from mm_serve.caption.inputs import InputFormat
from mm_serve.caption.records import row_id, row_succeeded
from mm_serve.ground.json_text import JSONTextError, load_json


class OutputError(ValueError):
    """OUT exists but cannot be resumed (unreadable, a corrupt line, another layout)."""


@dataclass(frozen=True)
class ResumeInfo:
    """What :meth:`OutputFile.open` found in an existing OUT.

    Attributes:
        done: ids that already have a row that is kept (they are skipped).
        dropped_errors: error rows removed because ``retry_errors`` was set.
        repaired_tail: True when a partial last line (from a kill) was cut off.
    """

    done: frozenset[str]
    dropped_errors: int
    repaired_tail: bool


class OutputFile:
    """An append-only JSONL writer holding an exclusive lock on OUT; build it with :meth:`open`."""

    def __init__(self, path: Path, handle: BinaryIO, fsync: bool) -> None:
        self.path = path
        self._handle = handle
        self._fsync = fsync

    @classmethod
    def open(cls, path: str | os.PathLike[str], fmt: InputFormat, *, retry_errors: bool = False,
             fsync: bool = False) -> tuple[OutputFile, ResumeInfo]:
        """Open (creating parent folders) or resume ``path`` for a job of input format ``fmt``.

        The file stays locked (``flock``) until :meth:`close`, so a second job on the
        same OUT fails at once instead of writing the same ids again.

        Raises:
            OutputError: OUT is a folder or anything else but a regular file (a device, a pipe),
                unreadable, locked by another job, has a corrupt line, or holds rows of another layout.
        """
        target = Path(path)
        if target.is_dir():
            raise OutputError(f"{target}: is a folder; --out needs a file path")
        if target.exists() and not target.is_file():  # /dev/zero would be read without end
            raise OutputError(f"{target}: is not a regular file (a device or a pipe); --out needs a file path")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            handle = _open_locked(target)
        except OSError as exc:
            raise OutputError(f"{target}: cannot open: {exc}") from None
        try:
            handle.seek(0)
            lines, rewrite, cut = _complete_lines(handle.read())
            rows = [_parse(target, number, line, fmt) for number, line in lines]
            kept = [line for (_, line), row in zip(lines, rows, strict=True) if not retry_errors or row_succeeded(row)]
            done = frozenset(row_id(fmt, row) or "" for row in rows if not retry_errors or row_succeeded(row))
            if len(kept) < len(lines) or rewrite:
                _rewrite(target, kept)
                handle.close()
                handle = _open_locked(target)
        except OSError as exc:
            handle.close()
            raise OutputError(f"{target}: cannot rewrite: {exc}") from None
        except BaseException:
            handle.close()
            raise
        return cls(target, handle, fsync), ResumeInfo(done, len(lines) - len(kept), cut)

    def append(self, row: dict[str, Any]) -> None:
        """Write one row as a line and flush it to the OS (and to disk with ``fsync``)."""
        self._handle.write(json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n")
        self._handle.flush()
        if self._fsync:
            os.fsync(self._handle.fileno())

    def close(self) -> None:
        """Flush, fsync, unlock and close. Idempotent."""
        if self._handle.closed:
            return
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()


def _open_locked(path: Path) -> BinaryIO:
    """``path`` opened for reading and appending, with an exclusive non-blocking ``flock``.

    Raises:
        OutputError: another process holds the lock.
        OSError: the file cannot be opened.
    """
    handle = open(path, "a+b")  # closed by OutputFile.close()
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise OutputError(f"{path}: another caption job is writing this file") from None
    return handle


def _complete_lines(data: bytes) -> tuple[list[tuple[int, bytes]], bool, bool]:
    """``([(line number, line), ...] non-blank, rewrite needed, partial line cut)`` of an existing OUT.

    A last line without its newline is kept when it is a complete JSON value (the
    file is rewritten to end in a newline) and cut when it is the start of a row but not
    complete (a kill mid-write); anything else there is kept, for :func:`_parse` to refuse.
    """
    lines = data.split(b"\n")
    tail = lines.pop()  # the bytes after the last newline: b"" for a complete file
    cut = False
    if tail.strip():
        try:
            load_json(tail)
            lines.append(tail)
        except JSONTextError:
            if tail.startswith(b"{"):  # each row is written as one line starting with its "{"
                cut = True
            else:
                lines.append(tail)
    numbered = [(number, line) for number, line in enumerate(lines, start=1) if line.strip()]
    return numbered, bool(tail.strip()), cut


def _parse(path: Path, number: int, line: bytes, fmt: InputFormat) -> dict[str, Any]:
    try:
        row = load_json(line)
    except JSONTextError:
        raise OutputError(f"{path}:{number}: not valid JSON; fix or delete that line, then re-run") from None
    if not isinstance(row, dict) or row_id(fmt, row) is None:
        layout = "an OpenAI batch output" if fmt == "openai-batch" else "a caption"
        raise OutputError(f"{path}:{number}: not {layout} row; is --out the output of another job?")
    return row


def _rewrite(path: Path, lines: list[bytes]) -> None:
    """Replace ``path`` with ``lines`` atomically (temp file, fsync, rename)."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temp, "wb") as out:
        out.write(b"".join(line + b"\n" for line in lines))
        out.flush()
        os.fsync(out.fileno())
    os.replace(temp, path)
