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
from collections.abc import Iterable
from pathlib import Path

from mm_serve.ground.roles import Role
from mm_serve.runtime.worker_spec import WorkerSpec

TASKS = Path("/proc/self/task")


def paced_decode_cpus(specs: Iterable[WorkerSpec]) -> set[int]:
    """The cores pinned to decode workers that pace their steps (``decode_step_pacing`` or
    ``decode_step_interval_s`` above 0); empty where none does or none is pinned (Ray actors)."""
    return {cpu for spec in specs if spec.role is Role.DECODE
            and (spec.sizing.decode_step_pacing > 0 or spec.sizing.decode_step_interval_s > 0)
            for cpu in spec.cpus}


def keep_off(cores: set[int], tasks: Path = TASKS) -> list[int] | None:
    """Pin every thread of this process (threads started later inherit it) to the cores it may use
    less ``cores``; the cores it runs on now, or None, changing nothing, where that would leave none or
    ``cores`` are not among them (Linux only: None elsewhere)."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    rest = allowed - cores
    if not rest or rest == allowed:
        return None
    for entry in tasks.iterdir():
        try:
            os.sched_setaffinity(int(entry.name), rest)
        except (OSError, ValueError):  # a thread that ended meanwhile
            continue
    return sorted(rest)
