"""A start removes what instances whose owner process is gone left behind, and only that."""

from __future__ import annotations

import _posixshmem
import os
import subprocess
import sys
import uuid
from pathlib import Path

from mm_serve.cluster.stale_instances import (
    SHM_DIR,
    owner_alive,
    process_start_time,
    remove_stale_instances,
)


def _instance(tmp: Path, pid: int, start: int | None) -> tuple[str, Path, Path]:
    instance = uuid.uuid4().hex[:12]
    run_dir = tmp / f"mmsrv-{instance}-abc"
    run_dir.mkdir()
    if start is not None:
        (run_dir / "owner").write_text(f"{pid} {start}\n")
    name = f"/mmsrv-{instance}-p0d0"
    os.close(_posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    return instance, run_dir, SHM_DIR / name[1:]


def test_only_instances_of_dead_owners_are_removed(tmp_path: Path) -> None:
    """Dead owner: run dir and segment go; live owner, reused pid of a live process, no owner file: kept."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child_start = process_start_time(child.pid)
    child.wait()
    me = os.getpid()
    my_start = process_start_time(me)
    assert child_start is not None and my_start is not None and process_start_time(child.pid) is None
    dead = _instance(tmp_path, child.pid, child_start)
    live = _instance(tmp_path, me, my_start)
    reused = _instance(tmp_path, me, my_start + 1)  # same pid, another start time: a different process
    unknown = _instance(tmp_path, 0, None)
    try:
        assert owner_alive(live[1]) is True and owner_alive(dead[1]) is False and owner_alive(unknown[1]) is None
        removed = remove_stale_instances(tmp_path)
        assert sorted(removed) == sorted([dead[0], reused[0]])
        assert not dead[1].exists() and not dead[2].exists()
        assert not reused[1].exists() and not reused[2].exists()
        assert live[1].is_dir() and live[2].exists() and unknown[1].is_dir() and unknown[2].exists()
    finally:
        for _, _, segment in (dead, live, reused, unknown):
            if segment.exists():
                _posixshmem.shm_unlink(f"/{segment.name}")


def test_a_start_after_a_sigkilled_service_removes_its_segments(tiny_llava: Path) -> None:
    """A front end killed with SIGKILL leaves segments; its workers exit by themselves, and the next
    start removes its segments and run directory while a live instance's stay."""
    import signal
    import time

    from mm_serve import LLM

    script = "\n".join([
        "import sys, time",
        "from mm_serve import LLM",
        "llm = LLM(model=sys.argv[1], num_pages=128)",
        "pool = llm.client.pool",
        "print(pool.instance, pool.run_dir, flush=True)",
        "print(*[p.pid for p in pool.processes], flush=True)",
        "time.sleep(600)",
    ])
    victim = subprocess.Popen([sys.executable, "-c", script, str(tiny_llava)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert victim.stdout is not None
    with LLM(model=tiny_llava, num_pages=128) as live:  # a live instance (started while the victim starts): untouched
        instance, run_dir = victim.stdout.readline().split()
        worker_pids = [int(p) for p in victim.stdout.readline().split()]
        live_instance = live.client.pool.instance
        assert list(SHM_DIR.glob(f"mmsrv-{instance}-*")) and Path(run_dir).is_dir()  # its owner lives: kept
        os.kill(victim.pid, signal.SIGKILL)  # from now on any instance starting on the machine may clean up
        victim.wait()
        deadline = time.monotonic() + 10
        while any(process_start_time(p) is not None for p in worker_pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(process_start_time(p) is None for p in worker_pids)  # orphaned workers exited
        with LLM(model=tiny_llava, num_pages=128):
            assert not list(SHM_DIR.glob(f"mmsrv-{instance}-*")) and not Path(run_dir).exists()
            assert list(SHM_DIR.glob(f"mmsrv-{live_instance}-*")) and live.client.pool.run_dir.is_dir()
        assert live.generate([{"prompt": "the circle"}])[0].outputs[0].token_ids  # the live one still serves


def test_the_named_semaphores_of_a_killed_process_group_are_removed_by_the_next_start(tmp_path: Path) -> None:
    """A process that named its semaphores (as the front end does before its body-parse pool) and was killed
    with its whole process group (its resource tracker too: docker kill, an OOM kill) leaves them in
    /dev/shm; the next start removes them, and a live process's stay."""
    import _multiprocessing
    import signal

    script = "\n".join([
        "import multiprocessing, time",
        "from mm_serve.cluster.stale_instances import name_own_semaphores",
        "name_own_semaphores()",
        "lock = multiprocessing.get_context('spawn').Lock()",
        "print(lock._semlock.name, flush=True)",
        "time.sleep(600)",
    ])
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              start_new_session=True) for _ in range(2)]
    names: list[str] = []
    try:
        names = [p.stdout.readline().strip() for p in procs if p.stdout is not None]
        files = [SHM_DIR / f"sem.{name[1:]}" for name in names]
        assert all(name.startswith(f"/mmsrv-p{p.pid}-") for name, p in zip(names, procs, strict=True)), names
        assert all(f.exists() for f in files)
        os.killpg(procs[0].pid, signal.SIGKILL)
        procs[0].wait()
        assert files[0].exists()  # nothing of its process group is left to unlink it
        remove_stale_instances(tmp_dir=tmp_path)
        assert not files[0].exists() and files[1].exists()
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for name in names:
            try:
                _multiprocessing.sem_unlink(name)
            except OSError:
                pass
