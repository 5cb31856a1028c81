"""How busy other processes keep this process's cores.

Linux's ``/proc/stat`` gives each core's busy time in clock ticks (proc(5)); less this process's own
CPU time (:func:`time.process_time`, all its threads, which run on its pinned cores), over the wall
time and the cores, that is the share other processes used. Two users:

* :class:`CoreLoad`, around a measurement: a profile timed while another program ran on the same
  cores prices every step too high (a 32-token prefill measured at 19 ms against 3.4 ms quiet), so
  :func:`mm_serve.planner.auto_placement.cached_profile` keeps such a profile for one start only.
  Steal time (a hypervisor giving the core to another guest) counts here.
* :class:`CoreDemand`, over a sliding window: a paced decode worker (:mod:`mm_serve.runtime.pacing`)
  sleeps between steps so that a prefill worker sharing its core gets the time; while that
  neighbour has nothing to do, the sleep only slows every running request (a step every 49 ms
  where an unpaced one takes 15), so the worker paces only while others want its cores. "Others"
  are any other processes on those cores (the front end's too, where it is not pinned elsewhere).
  Steal time does not count: sleeping gives nothing to another guest. A neighbour at a higher
  niceness still gets a share of the core while both want it (CFS weights: nice 10 beside nice 5
  gets about a quarter), so its demand shows while the decode worker runs unpaced, up to a gap of
  9 nice levels (about 12 %, over the 10 % threshold); a neighbour niced further below it is seen
  only once the decode worker pauses.

A free verdict also ends at once when the calling thread itself waited for its core: its run-queue
wait (``/proc/thread-self/schedstat``, field 2, nanoseconds) since its last look, at least
:data:`RUN_QUEUE_MIN_S` before, reaching the busy share (any thread that takes its core counts, the
process's own other threads too, such as a grammar compile; a kernel without schedstats, or one that
reads ``0 0 0``, leaves only the windows). A neighbour that starts while the decode worker steps
unpaced is then paced for within a step or two, not a window or two later.

Elsewhere than Linux, the share is unknown (None; :class:`CoreDemand` then always answers busy).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

PROC_STAT = Path("/proc/stat")
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user, nice, system, irq, softirq, steal (not idle 3, iowait 4, guest 8-9: inside user)
DEMAND_FIELDS = BUSY_FIELDS[:-1]  # the same less steal
DEMAND_WINDOW_S = 0.2  # CoreDemand: seconds between two readings; a verdict holds until the next one
DEMAND_BUSY_SHARE = 0.10  # CoreDemand: others' share of one core over a window from which the cores are busy
DEMAND_FREE_SHARE = 0.05  # CoreDemand: ... under which busy cores are free again
SCHEDSTAT = Path("/proc/thread-self/schedstat")  # this thread's CPU ns, run-queue wait ns, time slices
RUN_QUEUE_MIN_S = 0.02  # CoreDemand: the shortest span over which its run-queue wait is judged


def busy_ticks(cores: set[int], stat: str, fields: Iterable[int] = BUSY_FIELDS) -> int | None:
    """The busy clock ticks of ``cores`` since boot in ``stat`` (the text of ``/proc/stat``: lines
    ``cpuN user nice system idle iowait irq softirq steal guest guest_nice``), adding ``fields`` (their
    positions in such a line), or None when a core of them has no ``cpuN`` line."""
    fields = tuple(fields)
    found: dict[int, int] = {}
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            values = [int(x) for x in rest.split()]
            found[int(name[3:])] = sum(values[i] for i in fields if i < len(values))
    return sum(found.values()) if len(found) == len(cores) else None


class _Reading:
    """One look at the cores: monotonic seconds, their busy ticks (None: unreadable), own CPU seconds."""

    def __init__(self, cores: set[int], stat_path: Path, fields: tuple[int, ...]) -> None:
        try:
            self.ticks = busy_ticks(cores, stat_path.read_text(), fields) if cores else None
        except (OSError, ValueError):
            self.ticks = None
        self.cpu_s, self.wall_s = time.process_time(), time.monotonic()

    def others_share(self, start: _Reading, cores: int) -> float | None:
        """Share of ``cores`` cores' time (1: of one core's, whatever the number of cores read) that
        other processes used from ``start`` to this reading, clamped to [0, 1]; None when either reading
        failed or no time passed."""
        if self.ticks is None or start.ticks is None or self.wall_s <= start.wall_s or not cores:
            return None
        busy_s = (self.ticks - start.ticks) / os.sysconf("SC_CLK_TCK")
        other_s = busy_s - (self.cpu_s - start.cpu_s)
        return min(1.0, max(0.0, other_s / ((self.wall_s - start.wall_s) * cores)))


class CoreLoad:
    """Context manager: the share of ``cores``' time that other processes (and other guests, by the
    steal time) were busy during the ``with`` block.

    ``share`` = (busy seconds of ``cores`` − this process's CPU seconds) / (wall seconds × the number
    of cores), clamped to [0, 1]; None where ``/proc/stat`` cannot be read or has no line for a core.
    This process's threads are assumed to run on ``cores`` (its affinity: :func:`mm_serve.planner.auto_placement.usable_cores`).
    """

    def __init__(self, cores: list[int], stat_path: Path = PROC_STAT) -> None:
        self.cores = set(cores)
        self.stat_path = stat_path
        self.share: float | None = None
        self._start: _Reading | None = None

    def __enter__(self) -> CoreLoad:
        self._start = _Reading(self.cores, self.stat_path, BUSY_FIELDS)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._start is not None
        self.share = _Reading(self.cores, self.stat_path, BUSY_FIELDS).others_share(self._start, len(self.cores))


class CoreDemand:
    """Whether other processes want this process's cores: their CPU time over the last window.

    The verdict turns busy when others used at least ``busy_share`` of one core's time over a window
    (a neighbour on any one of several pinned cores counts whole), or at once when the calling thread
    waited that share of the time on its run queue; and free again only when others used less than
    ``free_share`` over a window: a hysteresis over ``/proc/stat``'s 10 ms ticks, which read a 0.2 s
    window to about ±5 %. Call :meth:`others_busy` at least every few windows, idle too, so that no
    window spans a long gap.

    Args:
        cores: the cores this process is pinned to; empty (unpinned) makes :meth:`others_busy` always
            True.
        window_s: seconds between readings (:data:`DEMAND_WINDOW_S`).
        busy_share: others' share of one core from which they count as busy (:data:`DEMAND_BUSY_SHARE`).
        free_share: others' share of one core under which a busy verdict ends (:data:`DEMAND_FREE_SHARE`).
        stat_path: ``/proc/stat``; while it cannot be read the verdict is busy (read again every window).
        schedstat_path: the calling thread's ``schedstat`` (:data:`SCHEDSTAT`); unreadable, only windows count.
    """

    def __init__(self, cores: Sequence[int], window_s: float = DEMAND_WINDOW_S, busy_share: float = DEMAND_BUSY_SHARE,
                 free_share: float = DEMAND_FREE_SHARE, stat_path: Path = PROC_STAT,
                 schedstat_path: Path = SCHEDSTAT) -> None:
        self.cores, self.stat_path, self.schedstat_path = set(cores), stat_path, schedstat_path
        self.window_s, self.busy_share, self.free_share = window_s, busy_share, free_share
        self.last_share: float | None = None  # others' share of one core over the last window (None before one)
        self._verdict = True  # busy until a window says otherwise: pacing as configured is the safe side
        self._last = _Reading(self.cores, stat_path, DEMAND_FIELDS)
        self._queued = self._run_queue_wait()  # (monotonic s, run-queue wait s) of the calling thread, or None

    def others_busy(self) -> bool:
        """True while other processes want the cores (the class docstring's rule; re-read at most every
        ``window_s``). True before the first full window, when unpinned, and while ``/proc/stat`` cannot
        be read."""
        if not self.cores:
            return True
        if not self._verdict and self._waited_for_core():
            self._verdict = True  # and a new window: freeing is judged on the time since
            self._last = _Reading(self.cores, self.stat_path, DEMAND_FIELDS)
            return True
        if time.monotonic() - self._last.wall_s < self.window_s:
            return self._verdict
        reading = _Reading(self.cores, self.stat_path, DEMAND_FIELDS)
        share = reading.others_share(self._last, 1)
        self._last = reading
        if share is None:  # this reading or the last one failed
            self.last_share, self._verdict = None, True
            return True
        self.last_share = share
        was_busy, self._verdict = self._verdict, share >= (self.free_share if self._verdict else self.busy_share)
        if was_busy and not self._verdict:  # the run-queue wait counts from here, not through the busy spell
            self._queued = self._run_queue_wait()
        return self._verdict

    def _run_queue_wait(self) -> tuple[float, float] | None:
        """(monotonic seconds, the calling thread's run-queue wait in seconds), None where unreadable."""
        try:
            waited_ns = int(self.schedstat_path.read_text().split()[1])
        except (OSError, ValueError, IndexError):
            return None
        return time.monotonic(), waited_ns / 1e9

    def _waited_for_core(self) -> bool:
        """Whether the calling thread waited on its core's run queue for at least ``busy_share`` of the
        time since the last look (judged over :data:`RUN_QUEUE_MIN_S` at least)."""
        last = self._queued
        if last is None:
            self._queued = self._run_queue_wait()
            return False
        now = time.monotonic()
        if now - last[0] < RUN_QUEUE_MIN_S:
            return False
        self._queued = current = self._run_queue_wait()
        return current is not None and current[1] - last[1] >= self.busy_share * (current[0] - last[0])
