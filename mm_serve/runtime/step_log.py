"""A JSON line per timed worker step, for finding where a step's time goes under load.

With ``MM_SERVE_STEP_LOG`` set to a file path, each worker process appends one line for every step
that it reports a :class:`~mm_serve.runtime.messages.StepTiming` for (prefill batches, decode steps,
a colocated worker's steps), as the front end's latency predictor receives it::

    {"time": 1796677983.44, "role": "colocated", "index": 0, "kind": "decode", "seconds": 0.0213,
     "requests": 16, "tokens": 6441, "images": 0, "cpu_seconds": 0.0189, "decode_requests": 0,
     "decode_context": 0}

``time`` is the Unix time of the report (seconds); the other fields are :class:`StepTiming`'s
(seconds, tokens; ``tokens`` of a decode step is its batch's context). Each line is one ``write``
to a file opened for appending, so the workers of one service can share the file.
``benchmarks/step_stall.py`` compares such a log with a profile. Unset (the default): nothing is
written. A path that cannot be opened, or names a FIFO or a socket, is said on ``mm-serve serve``'s console
at start (:func:`step_log_problem`) and the workers serve without the log. A failed or short write later
closes the log; it is said on the worker's console (its log file). The file has no size limit.
"""

from __future__ import annotations

import json
import os
import stat
import time

import msgspec

from mm_serve.ground.console import say
from mm_serve.runtime.messages import StepTiming

STEP_LOG_ENV = "MM_SERVE_STEP_LOG"


class StepLogError(Exception):
    """A step log path that cannot be used (the reason, e.g. ``cannot open (Is a directory)``)."""


def open_step_log(path: str) -> int:
    """A file descriptor of ``path`` opened for appending (created where missing; blocking writes).

    Raises:
        StepLogError: it cannot be opened (no such folder, a directory, no permission), or it is a FIFO
            or a socket (only a regular file or a device such as ``/dev/null`` is written).
    """
    try:
        # non-blocking: a FIFO without a reader fails here instead of holding the worker's start
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        raise StepLogError(f"cannot open ({exc.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
        os.close(fd)
        raise StepLogError("not a regular file or a device")
    os.set_blocking(fd, True)
    return fd


def step_log_problem() -> str | None:
    """Why ``MM_SERVE_STEP_LOG`` cannot be written, for the front end to say before the workers start (their
    own console is a log file); None where it is unset, empty or usable (then created)."""
    path = os.environ.get(STEP_LOG_ENV, "")
    if not path:
        return None
    try:
        os.close(open_step_log(path))
    except StepLogError as exc:
        return f"{STEP_LOG_ENV}={path}: {exc}; the workers serve without a step log"
    return None


class StepLog:
    """An open step log (:meth:`from_env` gives one where ``MM_SERVE_STEP_LOG`` is set)."""

    def __init__(self, fd: int, role: str, index: int) -> None:
        self._fd, self._role, self._index = fd, role, index

    @classmethod
    def from_env(cls, role: str, index: int) -> StepLog | None:
        """The log named by ``MM_SERVE_STEP_LOG`` for worker ``index`` of ``role``; None where it is unset
        or empty, or cannot be used (said once on the worker's console)."""
        path = os.environ.get(STEP_LOG_ENV, "")
        if not path:
            return None
        try:
            fd = open_step_log(path)
        except StepLogError as exc:
            say(f"[{role} {index}] {STEP_LOG_ENV}={path}: {exc}; serving without a step log")
            return None
        return cls(fd, role, index)

    def write(self, step: StepTiming) -> None:
        """Append ``step``'s line (a failed write, e.g. a full disk, closes the log: serving goes on; a closed
        log writes nothing)."""
        if self._fd < 0:
            return
        line = {"time": round(time.time(), 6), "role": self._role, "index": self._index, **msgspec.to_builtins(step)}
        data = (json.dumps(line) + "\n").encode()
        try:
            written = os.write(self._fd, data)
        except OSError as exc:
            say(f"[{self._role} {self._index}] {STEP_LOG_ENV}: write failed ({exc.strerror}); step log closed")
            self.close()
            return
        if written < len(data):  # a disk that is nearly full: the line is cut, and so would the next ones be
            say(f"[{self._role} {self._index}] {STEP_LOG_ENV}: short write ({written} of {len(data)} bytes); "
                "step log closed")
            self.close()

    def close(self) -> None:
        """Close the file (again: nothing)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
