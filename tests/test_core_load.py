"""Other processes' share of this process's cores, from /proc/stat (mm_serve.runtime.core_load)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mm_serve.runtime import core_load
from mm_serve.runtime.core_load import DEMAND_FIELDS, CoreDemand, CoreLoad, busy_ticks

linux_two_cores = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2 or not Path("/proc/stat").exists(),
    reason="needs Linux's /proc/stat and two usable cores")


def test_busy_ticks_add_the_named_fields_of_the_named_cores_only(tmp_path: Path) -> None:
    """User, nice, system, irq, softirq and steal (not idle, iowait or guest) by default, steal left
    out for demand; unknown without a core's line; an unreadable file gives no share."""
    stat = ("cpu  9 9 9 9 9 9 9 9 9 9\ncpu0 1 2 3 100 50 4 5 6 70 80\ncpu1 10 0 0 0 0 0 0 0 0 0\n"
            "cpu2 1000 0 0 0 0 0 0 0 0 0\nintr 5 6\n")
    assert busy_ticks({0}, stat) == 1 + 2 + 3 + 4 + 5 + 6
    assert busy_ticks({0}, stat, DEMAND_FIELDS) == 1 + 2 + 3 + 4 + 5
    assert busy_ticks({0, 1}, stat) == 21 + 10
    assert busy_ticks({0, 3}, stat) is None
    with CoreLoad([0], tmp_path / "missing") as unknown:
        pass
    assert unknown.share is None
    assert CoreDemand([]).others_busy()  # unpinned: pace as configured


class _Machine:
    """A fake /proc/stat and clocks: ``advance(wall, own, others)`` moves time on, this process using
    ``own`` and other processes ``others`` CPU seconds of core 1 (10 ms ticks), while a hypervisor
    steals as much again (steal is not demand)."""

    def __init__(self, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.path, self.wall, self.cpu, self.ticks, self.steal = path, 1000.0, 5.0, 0, 300
        self.schedstat, self.waited_ns = path.with_name("schedstat"), 7_000
        monkeypatch.setattr(core_load.time, "monotonic", lambda: self.wall)
        monkeypatch.setattr(core_load.time, "process_time", lambda: self.cpu)
        self._write()

    def _write(self) -> None:
        self.path.write_text(f"cpu  0 0 0 0 0 0 0 0\ncpu0 7 0 0 0 0 0 0 0\ncpu1 {self.ticks} 0 0 5 0 0 0 {self.steal}\n")
        self.schedstat.write_text(f"{round(self.cpu * 1e9)} {self.waited_ns} 40\n")

    def advance(self, wall: float, own: float, others: float, waited: float = 0.0) -> None:
        """... this thread waiting ``waited`` seconds on its run queue meanwhile."""
        self.wall += wall
        self.cpu += own
        self.ticks += round((own + others) * 100)
        self.steal += round(others * 100)
        self.waited_ns += round(waited * 1e9)
        self._write()


def test_core_demand_turns_busy_at_a_tenth_of_a_core_and_free_under_a_twentieth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Busy before a full window; readings at most every window (a verdict holds between them); its
    own CPU time and steal are not others'; busy from 10 % of one core (whatever the number of pinned
    cores), free again only under 5 %; unreadable /proc/stat: busy, read again next window."""
    machine = _Machine(tmp_path / "stat", monkeypatch)
    demand = CoreDemand([1], window_s=0.2, stat_path=machine.path, schedstat_path=tmp_path / "none")
    assert demand.others_busy() and demand.last_share is None
    machine.advance(0.1, own=0.1, others=0.0)
    assert demand.others_busy() and demand.last_share is None  # within the window: no reading
    machine.advance(0.1, own=0.1, others=0.0)
    assert not demand.others_busy() and demand.last_share == pytest.approx(0.0)  # its own work only
    machine.advance(0.2, own=0.184, others=0.016)
    assert not demand.others_busy() and demand.last_share == pytest.approx(0.08)  # under 10 %: still free
    machine.advance(0.2, own=0.17, others=0.03)
    assert demand.others_busy() and demand.last_share == pytest.approx(0.15)
    machine.advance(0.2, own=0.004, others=0.016)
    assert demand.others_busy() and demand.last_share == pytest.approx(0.08)  # busy until under 5 %
    machine.advance(0.5, own=0.18, others=0.02)
    assert not demand.others_busy() and demand.last_share == pytest.approx(0.04)
    both = CoreDemand([0, 1], window_s=0.2, stat_path=machine.path, schedstat_path=tmp_path / "none")
    machine.advance(0.2, own=0.0, others=0.05)  # a quarter of one core: an eighth of the two
    assert both.others_busy() and both.last_share == pytest.approx(0.25)
    machine.path.unlink()
    machine.wall += 0.2
    assert both.others_busy() and both.last_share is None
    machine.advance(0.2, own=0.2, others=0.0)
    assert both.others_busy()  # the window from the failed reading has no start
    machine.advance(0.2, own=0.2, others=0.0)
    assert not both.others_busy()


@pytest.fixture
def pinned_to_last_core() -> Iterator[int]:
    """This process pinned to its last usable core for the test (restored after)."""
    before = os.sched_getaffinity(0)
    core = max(before)
    os.sched_setaffinity(0, {core})
    try:
        yield core
    finally:
        os.sched_setaffinity(0, before)


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@linux_two_cores
def test_core_demand_sees_a_niced_neighbour_not_its_own_work(pinned_to_last_core: int) -> None:
    """On the real kernel: this process spinning on its core is not counted (its own time is left
    out: far under the full core it takes); a busy loop 5 nice levels lower pinned to the same core
    (a prefill worker beside a decode worker) takes its CFS share, about a quarter, even while this
    process spins, and the core counts as busy; meanwhile this thread's run-queue wait
    (``/proc/thread-self/schedstat``) grows by the neighbour's slices."""
    core = pinned_to_last_core
    demand = CoreDemand([core], window_s=0.3)
    _spin(0.35)
    demand.others_busy()
    alone = demand.last_share
    loop = (f"import os, time\nos.sched_setaffinity(0, {{{core}}})\nos.nice(5)\n"
            "end = time.monotonic() + 20\nwhile time.monotonic() < end: pass")
    neighbour = subprocess.Popen([sys.executable, "-c", loop])
    schedstat = Path("/proc/thread-self/schedstat")
    try:
        time.sleep(0.3)  # it starts, pins itself and spins
        demand.others_busy()  # a window with its start-up in it
        waited_before = int(schedstat.read_text().split()[1]) if schedstat.exists() else None
        _spin(0.35)
        beside_busy, beside = demand.others_busy(), demand.last_share
        waited = None if waited_before is None else (int(schedstat.read_text().split()[1]) - waited_before) / 1e9
    finally:
        neighbour.kill()
        neighbour.wait()
    assert alone is not None and alone < 0.5, alone
    assert beside is not None and beside >= 0.15 and beside_busy, beside
    if waited is not None and waited_before:  # field 2: this thread's run-queue wait in ns, the neighbour's slices
        assert waited >= 0.03, waited


def test_waiting_on_its_run_queue_makes_the_core_busy_within_a_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Free, the thread that waited 10 % or more of the time since its last look (20 ms at least) on
    its run queue (a neighbour took the core from it) turns the verdict busy at once, mid-window, and
    a new window begins; less wait, or a span under 20 ms, does not. Only a window with others under
    5 % frees it again, and the run-queue wait counts afresh from there."""
    machine = _Machine(tmp_path / "stat", monkeypatch)
    demand = CoreDemand([1], window_s=0.2, stat_path=machine.path, schedstat_path=machine.schedstat)
    machine.advance(0.2, own=0.2, others=0.0)
    assert not demand.others_busy()
    machine.advance(0.03, own=0.03, others=0.0, waited=0.002)  # 7 %
    assert not demand.others_busy()
    machine.advance(0.01, own=0.0, others=0.0, waited=0.005)  # half of 10 ms: too short a span to judge
    assert not demand.others_busy()
    machine.advance(0.02, own=0.02, others=0.0, waited=0.0)  # 5 ms of the 30 ms since the last judged look
    assert demand.others_busy() and demand.last_share == pytest.approx(0.0)  # busy before the window ends
    machine.advance(0.15, own=0.1, others=0.05)  # a new window began when it turned busy: not over yet
    assert demand.others_busy()
    machine.advance(0.06, own=0.06, others=0.0, waited=0.04)  # the window: others 24 %, still busy
    assert demand.others_busy() and demand.last_share == pytest.approx(0.05 / 0.21)
    machine.advance(0.2, own=0.2, others=0.0, waited=0.03)  # nobody else over a window: free
    assert not demand.others_busy() and demand.last_share == pytest.approx(0.0)
    machine.advance(0.03, own=0.03, others=0.0)  # the waits of the busy spell do not count after it
    assert not demand.others_busy()
