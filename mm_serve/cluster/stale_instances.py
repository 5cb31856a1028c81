"""Remove what service instances whose owner process is gone left behind (and only that).

Each instance's run directory (``<tmp>/mmsrv-<instance>-*``) holds an ``owner`` file with
the owning front end's pid and that process's start time (``/proc/<pid>/stat`` field 22,
clock ticks since boot), so a pid reused by another process is not taken for the owner.
An instance whose owner no longer runs — a front end killed with SIGKILL — has its run
directory and its shared-memory segments (``/dev/shm/mmsrv-<instance>-*``) removed when
the next instance starts. A run directory without an owner file, or whose owner is
alive, is left alone.

The named semaphores ``multiprocessing`` makes for a spawned pool (the front end's body-parse
process) are unlinked by its resource tracker at exit, which a SIGKILL of the whole process
group takes too. :func:`name_own_semaphores` names them after their process
(``/dev/shm/sem.mmsrv-p<pid>-<start time>-mp-*``), and the next start removes those of a
process that no longer runs.
"""

from __future__ import annotations

import _multiprocessing
import _posixshmem
import multiprocessing
import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "mmsrv-"
OWNER_FILE = "owner"
SHM_DIR = Path("/dev/shm")


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None when it does not run."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # fields after "(comm)"; field 22 overall


def write_owner(run_dir: Path) -> None:
    """Record this process as the owner of ``run_dir``."""
    pid = os.getpid()
    (run_dir / OWNER_FILE).write_text(f"{pid} {process_start_time(pid) or 0}\n")


def owner_alive(run_dir: Path) -> bool | None:
    """Whether the owner recorded in ``run_dir`` still runs; None without a readable owner file."""
    try:
        pid_text, start_text = (run_dir / OWNER_FILE).read_text().split()
        pid, start = int(pid_text), int(start_text)
    except (OSError, ValueError):
        return None
    return process_start_time(pid) == start


SEMAPHORE_PREFIX = "mmsrv-p"


def name_own_semaphores() -> None:
    """Name the semaphores ``multiprocessing`` makes in this process from now on after it (its pid and start
    time: ``/mmsrv-p<pid>-<start>-mp-<n>``) instead of ``/mp-<n>``, so that :func:`remove_stale_instances`
    can tell those of a process that is gone. The prefix is ``multiprocessing``'s ``semprefix`` (a
    process attribute it reads for every new semaphore name)."""
    pid = os.getpid()
    multiprocessing.current_process()._config["semprefix"] = (  # type: ignore[attr-defined]
        f"/{SEMAPHORE_PREFIX}{pid}-{process_start_time(pid) or 0}-mp")


def _remove_stale_semaphores(shm_dir: Path) -> None:
    """Unlink the semaphores named by :func:`name_own_semaphores` whose process no longer runs."""
    for path in shm_dir.glob(f"sem.{SEMAPHORE_PREFIX}*"):
        try:
            pid_text, start_text = path.name[len("sem." + SEMAPHORE_PREFIX):].split("-")[:2]
            alive = process_start_time(int(pid_text)) == int(start_text)
        except ValueError:
            continue
        if not alive:
            try:
                _multiprocessing.sem_unlink("/" + path.name[len("sem."):])
            except OSError:
                pass


def remove_stale_instances(tmp_dir: Path | None = None, shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove run directories and segments of instances whose owner is gone, and the semaphores of
    processes that are gone (:func:`name_own_semaphores`).

    Returns:
        The instance ids removed.
    """
    _remove_stale_semaphores(shm_dir)
    removed = []
    for run_dir in sorted(Path(tmp_dir or tempfile.gettempdir()).glob(f"{PREFIX}*")):
        parts = run_dir.name.split("-")
        if len(parts) < 3 or not run_dir.is_dir() or owner_alive(run_dir) is not False:
            continue
        instance = parts[1]
        for segment in shm_dir.glob(f"{PREFIX}{instance}-*"):
            try:
                _posixshmem.shm_unlink(f"/{segment.name}")
            except OSError:
                pass
        shutil.rmtree(run_dir, ignore_errors=True)
        removed.append(instance)
    return removed
