"""The serving process keeps off the cores of decode workers that pace (mm_serve.cluster.front_end_cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mm_serve.cluster.front_end_cores import keep_off, paced_decode_cpus
from mm_serve.ground.roles import Role
from mm_serve.runtime.engine_config import EngineConfig
from mm_serve.runtime.worker_spec import WorkerSpec

linux_two_cores = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2 or not Path("/proc/self/task").is_dir(),
    reason="needs Linux and two usable cores")


def _spec(role: Role, cpus: list[int], **sizing: float) -> WorkerSpec:
    return WorkerSpec(role=role, index=0, model_dir="m", sizing=EngineConfig(**sizing), control_address="c",
                      output_address="o", cpus=cpus)


def test_only_pinned_decode_workers_that_pace_count() -> None:
    specs = [_spec(Role.PREFILL, [0, 1], decode_step_pacing=0.7), _spec(Role.DECODE, [1], decode_step_pacing=0.7),
             _spec(Role.DECODE, [2]), _spec(Role.DECODE, [3], decode_step_interval_s=0.05),
             _spec(Role.DECODE, [], decode_step_pacing=0.5),  # a Ray actor: not pinned
             _spec(Role.DECODE, [4], decode_step_pacing=0.5, decode_pacing_always=True)]  # paces whatever runs beside
    assert paced_decode_cpus(specs) == {1, 3}
    assert paced_decode_cpus([_spec(Role.COLOCATED, [0, 1]), _spec(Role.DECODE, [1])]) == set()


def test_nothing_changes_without_cores_to_leave_or_to_go_to() -> None:
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    assert keep_off(set()) is None
    assert keep_off(set(allowed)) is None  # it would leave no core
    assert keep_off({max(allowed, default=0) + 1000}) is None  # not a core it runs on
    assert (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()) == allowed


@linux_two_cores
def test_every_thread_moves_off_the_cores_and_new_threads_follow() -> None:
    """In a child process (the pin is the process's): a thread started before and one started after
    both run on the remaining cores only, and so does its own child process (a body-parse process),
    but not the child named a worker (it pins itself)."""
    last = max(os.sched_getaffinity(0))
    code = f"""
import json, os, threading, time
from pathlib import Path
from mm_serve.cluster.front_end_cores import keep_off
ready, done = threading.Event(), threading.Event()
def idle():
    ready.set()
    done.wait()
before = threading.Thread(target=idle)
before.start()
ready.wait()
import subprocess, sys
parse = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
time.sleep(0.5)
now = keep_off({{{last}}}, {{worker.pid}})
after = threading.Thread(target=done.wait)
after.start()
seen = {{int(t.name): sorted(os.sched_getaffinity(int(t.name))) for t in Path("/proc/self/task").iterdir()}}
children = {{"parse": sorted(os.sched_getaffinity(parse.pid)), "worker": sorted(os.sched_getaffinity(worker.pid))}}
done.set()
parse.kill(); worker.kill(); parse.wait(); worker.wait()
print(json.dumps({{"now": now, "threads": seen, "children": children}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(out.stdout)
    rest = sorted(os.sched_getaffinity(0) - {last})
    assert result["now"] == rest
    assert len(result["threads"]) >= 3 and all(cores == rest for cores in result["threads"].values())
    assert result["children"] == {"parse": rest, "worker": sorted(os.sched_getaffinity(0))}
