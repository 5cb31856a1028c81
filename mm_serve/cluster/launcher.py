"""Start and stop worker processes on this node; assign CPU cores (Ray actors on other
nodes: :mod:`mm_serve.cluster.ray_launch`).

Workers are separate OS processes (``python -m mm_serve.cluster.worker_main``),
each given a :class:`WorkerSpec` on its command line. They exit on
:class:`~mm_serve.runtime.messages.Shutdown`, and on their own when the launching
process disappears, so no worker outlives the service.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Protocol

from mm_serve.runtime.worker_spec import WorkerSpec, encode_spec


class WorkerProcess(Protocol):
    """What the worker pool uses of a worker: a ``subprocess.Popen`` here, or a Ray actor's
    handle (:class:`mm_serve.cluster.ray_worker.RayWorkerHandle`) on a cluster."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def available_cpus() -> list[int]:
    """Cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def split_cpus(cpus: list[int], num_workers: int) -> list[list[int]]:
    """Give each of ``num_workers`` workers a contiguous share of ``cpus`` (shared when too few)."""
    if not cpus:
        return [[] for _ in range(num_workers)]
    if len(cpus) < num_workers:
        return [[cpus[i % len(cpus)]] for i in range(num_workers)]
    per = len(cpus) // num_workers
    return [cpus[i * per : (i + 1) * per] for i in range(num_workers)]


def default_role_cpus(num_prefill: int, num_decode: int) -> tuple[list[int], list[int]]:
    """Auto placement: prefill on the first half of the cores, decode on the rest (shared if one core)."""
    cpus = available_cpus()
    if len(cpus) < 2:
        return cpus, cpus
    cut = max(1, len(cpus) * num_prefill // (num_prefill + num_decode))
    cut = min(cut, len(cpus) - 1)
    return cpus[:cut], cpus[cut:]


def start_worker(spec: WorkerSpec, log_path: str | None = None) -> subprocess.Popen[bytes]:
    """Spawn one worker process; its stdout/stderr go to ``log_path`` (or are inherited)."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - owned by the child
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "mm_serve.cluster.worker_main", encode_spec(spec)],
            env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
        )
    finally:
        if out:
            out.close()


def stop_workers(processes: list[WorkerProcess], timeout_s: float = 10.0) -> None:
    """Wait up to ``timeout_s`` seconds for workers to exit (after a Shutdown message), then kill
    the stragglers (workers ignore SIGTERM and SIGINT: the front end decides when they stop)."""
    deadline = time.monotonic() + timeout_s
    for proc in processes:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
