"""Keep the serving process (the front end) off the cores of decode workers that pace their steps.

A paced decode worker sleeps between steps while another process wants its core
(:class:`mm_serve.runtime.core_load.CoreDemand`), so that a prefill worker sharing that core gets the
time. An unpinned front end is such a process too: the scheduler wakes it on the decode worker's core
(the worker's output wakes it) and its work for the very streams being decoded, over a tenth of a core
for one stream, made an idle paced service pace every few tokens. Pinned to the other cores, it never
takes the decode core; it still wins its own cores from the workers there (its niceness is 0 against
their ``compute.worker_nice``).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable
from pathlib import Path

from mm_serve.ground.roles import Role
from mm_serve.runtime.thread_affinity import PROC, pin_threads
from mm_serve.runtime.worker_spec import WorkerSpec

PASSES = 5  # keep_off: passes over the threads until none is left on the cores (threads may start meanwhile)


def paced_decode_cpus(specs: Iterable[WorkerSpec]) -> set[int]:
    """The cores pinned to decode workers that pace their steps while another process wants their core
    (``decode_step_pacing`` or ``decode_step_interval_s`` above 0, ``decode_pacing_always`` off: a worker
    pacing every step paces whatever runs beside it); empty where none does or none is pinned (Ray)."""
    return {cpu for spec in specs if spec.role is Role.DECODE and not spec.sizing.decode_pacing_always
            and (spec.sizing.decode_step_pacing > 0 or spec.sizing.decode_step_interval_s > 0)
            for cpu in spec.cpus}


def _children(proc: Path, pid: int) -> set[int]:
    """The child processes of ``pid`` (``/proc/<pid>/task/*/children``; empty where unreadable)."""
    found: set[int] = set()
    try:
        for task in (proc / str(pid) / "task").iterdir():
            found |= {int(c) for c in (task / "children").read_text().split()}
    except (OSError, ValueError):
        pass
    return found


def keep_off(cores: set[int], workers: Collection[int] = (), proc: Path = PROC) -> list[int] | None:
    """Pin every thread of this process, and of its child processes but ``workers`` (the body-parse
    process, say), to the cores it may use less ``cores``; threads and processes started later inherit it.
    Passes are repeated until a pass finds every thread pinned (a thread not yet pinned may start another
    meanwhile), :data:`PASSES` at most. The cores it runs on now, or None, changing nothing, where that
    would leave none, ``cores`` are not among them, or ``/proc`` cannot be read (Linux only)."""
    if not cores or not hasattr(os, "sched_setaffinity") or not (proc / "self" / "task").is_dir():
        return None
    allowed = os.sched_getaffinity(0)
    rest = allowed - cores
    if not rest or rest == allowed:
        return None
    pid = os.getpid()
    for _ in range(PASSES):
        settled = pin_threads(pid, rest, proc) is not False  # None: gone, nothing left to pin
        for child in _children(proc, pid) - set(workers):
            settled = pin_threads(child, rest, proc) is not False and settled
        if settled:
            break
    return sorted(rest)
