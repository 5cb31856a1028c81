"""Status lines on a console whose reader may have gone."""

from __future__ import annotations

import os
import sys
from typing import TextIO


def say(line: str, stream: TextIO | None = None) -> None:
    """Write ``line`` and a newline to ``stream`` (default: ``sys.stderr``) and flush it.

    When the stream's reader has gone (``mm-serve serve 2>&1 | head`` after head exits: the write
    fails with EPIPE), the line is dropped and the stream's file descriptor is pointed at /dev/null, so
    later lines, uvicorn's log and the interpreter's flush at exit are dropped too. Raising
    BrokenPipeError instead would end the signal handler or worker loop that printed: a server that
    ignores SIGTERM, a worker that dies on a notice. Other errors (a closed file object) propagate.
    """
    stream = sys.stderr if stream is None else stream
    try:
        stream.write(line + "\n")
        stream.flush()
    except BrokenPipeError:
        drop_output(stream)


def drop_output(stream: TextIO) -> None:
    """Point ``stream``'s file descriptor at /dev/null: what is written to it from now on (and what its
    buffer still holds, flushed at exit) goes nowhere instead of raising BrokenPipeError again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, stream.fileno())
    finally:
        os.close(devnull)
