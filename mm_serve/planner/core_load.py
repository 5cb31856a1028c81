"""How busy other processes kept this process's cores while it measured something.

A profile timed while another program ran on the same cores prices every step too high (a 32-token
prefill measured at 19 ms against 3.4 ms quiet), and a cached profile steers every later start. The
share here lets :func:`mm_serve.planner.auto_placement.cached_profile` keep such a profile for one
start only. It reads Linux's ``/proc/stat`` (per-core busy time in clock ticks: user, nice, system,
irq, softirq and steal, the time a hypervisor gave the core to another guest) and this process's own
CPU time; elsewhere the share is unknown (None).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PROC_STAT = Path("/proc/stat")
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user, nice, system, irq, softirq, steal (not idle 3, iowait 4, guest 8-9: inside user)


def busy_ticks(cores: set[int], stat: str) -> int | None:
    """The busy clock ticks of ``cores`` since boot in ``stat`` (the text of ``/proc/stat``), or None
    when a core of them has no ``cpuN`` line."""
    found: dict[int, int] = {}
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            fields = [int(x) for x in rest.split()]
            found[int(name[3:])] = sum(fields[i] for i in BUSY_FIELDS if i < len(fields))
    return sum(found.values()) if len(found) == len(cores) else None


class CoreLoad:
    """Context manager: the share of ``cores``' time that other processes (and other guests, by the
    steal time) were busy during the ``with`` block.

    ``share`` = (busy seconds of ``cores`` − this process's CPU seconds) / (wall seconds × the number
    of cores), clamped to [0, 1]; None where ``/proc/stat`` cannot be read or has no line for a core.
    This process's threads are assumed to run on ``cores`` (its affinity: :func:`usable_cores`).
    """

    def __init__(self, cores: list[int], stat_path: Path = PROC_STAT) -> None:
        self.cores = set(cores)
        self.stat_path = stat_path
        self.share: float | None = None
        self._start: tuple[int | None, float, float] = (None, 0.0, 0.0)

    def _read(self) -> int | None:
        try:
            return busy_ticks(self.cores, self.stat_path.read_text())
        except (OSError, ValueError):
            return None

    def __enter__(self) -> CoreLoad:
        self._start = (self._read(), time.process_time(), time.monotonic())
        return self

    def __exit__(self, *exc: object) -> None:
        ticks, cpu, wall = self._read(), time.process_time(), time.monotonic()
        start_ticks, start_cpu, start_wall = self._start
        if ticks is None or start_ticks is None or wall <= start_wall or not self.cores:
            return
        busy_s = (ticks - start_ticks) / os.sysconf("SC_CLK_TCK")
        other_s = busy_s - (cpu - start_cpu)
        self.share = min(1.0, max(0.0, other_s / ((wall - start_wall) * len(self.cores))))
