"""Pin every thread of a process to a set of cores (``sched_setaffinity`` sets one thread's only)."""

from __future__ import annotations

import os
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
