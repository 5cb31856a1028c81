"""Other processes' share of this process's cores, from /proc/stat (mm_serve.runtime.core_load)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

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
    assert CoreDemand([0], stat_path=tmp_path / "missing").others_busy()  # unknown: pace as configured
    assert CoreDemand([]).others_busy()  # unpinned: likewise


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
def test_core_demand_sees_a_neighbour_not_its_own_work(pinned_to_last_core: int) -> None:
    """Spinning alone on the core, this process's own time is left out: the window's share stays low
    and the core counts as free. A niced busy loop pinned to the same core (a prefill worker beside a
    decode worker) takes its CFS share even while this process spins: the core counts as busy."""
    core = pinned_to_last_core
    demand = CoreDemand([core], window_s=0.3)
    _spin(0.35)
    alone_busy, alone = demand.others_busy(), demand.last_share
    loop = (f"import os, time\nos.sched_setaffinity(0, {{{core}}})\nos.nice(5)\n"
            "end = time.monotonic() + 20\nwhile time.monotonic() < end: pass")
    neighbour = subprocess.Popen([sys.executable, "-c", loop])
    try:
        time.sleep(0.3)  # it starts, pins itself and spins
        demand.others_busy()  # a window with its start-up in it
        _spin(0.35)
        beside_busy, beside = demand.others_busy(), demand.last_share
    finally:
        neighbour.kill()
        neighbour.wait()
    assert alone is not None and beside is not None
    assert beside >= 0.15 and beside_busy, (alone, beside)
    assert alone < beside - 0.1, (alone, beside)
    assert not alone_busy or alone >= 0.15, alone  # the verdict follows the share


def test_a_verdict_holds_for_its_window() -> None:
    """Between two readings the last verdict stands (no /proc read per decode step)."""
    demand = CoreDemand([0], window_s=60.0)
    assert demand.others_busy() and demand.last_share is None  # no full window yet: busy
