"""What the worker pool records of each worker, and what it reports: status, failures, health."""

from __future__ import annotations

import enum
import signal
from collections import deque
from dataclasses import dataclass, field

import msgspec

from mm_serve.cluster.launcher import WorkerProcess
from mm_serve.runtime.worker_spec import WorkerSpec

WorkerKey = tuple[str, int]
"""(role, index) of one worker; the role is a :class:`~mm_serve.ground.roles.Role` (a ``str``
enum: ``("decode", 0)`` names the same worker)."""


USER_ERROR_EXIT = 2  # a worker's exit status when what it was given cannot be loaded (its checkpoint)


class WorkerStartError(RuntimeError):
    """A worker exited or did not report ready in time; the message has its log tail. ``user_error``: what
    the user gave cannot serve (a checkpoint a worker cannot load, KV caches past the host's memory), and
    the message says what, in one line."""

    def __init__(self, message: str, user_error: bool = False) -> None:
        super().__init__(message)
        self.user_error = user_error


def exit_description(code: int) -> str:
    """``exited with code <code>``, naming the signal of a negative code; SIGKILL that nothing here sent is
    most often the kernel's out-of-memory killer, which leaves nothing in the worker's log."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"exited with code {code}"
    oom = " (when nothing else sent it, the kernel's out-of-memory killer: see `dmesg`)" if name == "SIGKILL" else ""
    return f"exited with code {code}, killed by {name}{oom}"


class WorkerStatus(str, enum.Enum):
    """What ``/health`` says of one worker."""

    WARMING = "warming"  # first start, not ready yet
    READY = "ready"
    RESTARTING = "restarting"  # failed; waiting for its back-off, or started again and loading
    DOWN = "down"  # failed more than fault.max_restarts times in the window: not restarted


@dataclass
class WorkerFailure:
    """One worker found failed by :meth:`~mm_serve.cluster.worker_pool.WorkerPool.supervise`."""

    key: WorkerKey
    reason: str  # "exited with code -9", "hung: no heartbeat for 10.2 s", ...
    down: bool  # True when it will not be restarted


@dataclass
class WorkerRecord:
    """The pool's record of one worker: its current spec and process, and its supervision state.

    Times are ``time.monotonic()`` seconds.
    """

    spec: WorkerSpec
    process: WorkerProcess | None = None
    status: WorkerStatus = WorkerStatus.WARMING
    pid: int = 0
    last_seen: float = 0.0  # its last message
    started_at: float = 0.0
    restart_at: float | None = None  # when to start it again (RESTARTING, not yet started)
    restarts: deque[float] = field(default_factory=deque)  # times of its restarts
    generation: int = 0
    last_failure: str = ""
    pending: list[msgspec.Struct] = field(default_factory=list)  # control messages for when it is ready

    @property
    def loading(self) -> bool:
        """Started and not ready yet (it may still attach the rings of its start-up spec)."""
        return self.status is not WorkerStatus.READY and self.process is not None


def health_report(workers: dict[WorkerKey, WorkerRecord], serving: bool) -> dict[str, object]:
    """``status`` (``ok``: every worker ready; ``degraded``: some are not but a path serves
    (``serving``); ``warming``: the first start is under way; ``down``: no path serves),
    per-worker ``workers`` (``ready | warming | restarting | down``) and ``faults`` (the last
    failure of each worker that had one), keyed ``"<role><index>"``."""
    statuses = {f"{r}{i}": w.status.value for (r, i), w in workers.items()}
    faults = {f"{r}{i}": w.last_failure for (r, i), w in workers.items() if w.last_failure}
    if statuses and all(v == "ready" for v in statuses.values()):
        status = "ok"
    elif serving:
        status = "degraded"
    elif statuses and all(w.status is WorkerStatus.WARMING or w.status is WorkerStatus.READY
                          for w in workers.values()) and not faults:
        status = "warming"
    else:
        status = "down"
    return {"status": status, "workers": statuses, "faults": faults}
