"""Where and how eagerly threads run: pin every thread of a process to a set of cores
(``sched_setaffinity`` sets one thread's only), or lower the calling thread's priority."""

from __future__ import annotations

import os
import threading
from pathlib import Path

PROC = Path("/proc")


def pin_threads(pid: int, cores: set[int], proc: Path = PROC) -> bool | None:
    """One pass over the threads of ``pid`` (``/proc/<pid>/task``): each not on ``cores`` alone is pinned
    to them (threads it starts later inherit its set). Whether every thread already was; None where the
    threads cannot be listed (the process is gone, or no ``/proc``). A thread that ends meanwhile is
    skipped."""
    try:
        tids = [int(entry.name) for entry in (proc / str(pid) / "task").iterdir() if entry.name.isdigit()]
    except OSError:
        return None
    settled = True
    for tid in tids:
        try:
            if os.sched_getaffinity(tid) != cores:
                os.sched_setaffinity(tid, cores)
                settled = False
        except OSError:
            continue
    return settled


def lower_thread_priority(nice: int) -> None:
    """Add ``nice`` to the calling thread's niceness, up to 19 (Linux: a thread is a task of its own;
    elsewhere nothing)."""
    if nice and hasattr(os, "setpriority"):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
