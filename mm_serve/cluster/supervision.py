"""When a worker has failed, and when (or whether) it starts again.

A worker that exits (any code) has failed; so has a ready worker that sends nothing for
``fault.heartbeat_timeout_s`` (stats come every ``stats_interval_s`` between steps: it is
hung, e.g. SIGSTOPped) and a restarted worker not ready ``fault.start_timeout_s`` after its
start. A failed worker is restarted after ``fault.restart_backoff_s``, doubled for each
restart already in ``fault.restart_window_s`` and at most :data:`MAX_BACKOFF_S`; past
``fault.max_restarts`` restarts in the window it stays down and the service runs on the
others. :class:`~mm_serve.cluster.worker_pool.WorkerPool` applies these rules.
"""

from __future__ import annotations

from mm_serve.cluster.worker_state import WorkerKey, WorkerRecord, WorkerStatus, exit_description
from mm_serve.config import FaultConfig

MAX_BACKOFF_S = 10.0
"""The doubling back-off never waits longer than this, in seconds."""


def failure_reason(worker: WorkerRecord, now: float, fault: FaultConfig) -> str | None:
    """Why ``worker`` has failed at monotonic time ``now``, or None while it is fine (or
    not running: down, or waiting for its restart)."""
    if worker.status is WorkerStatus.DOWN or worker.process is None:
        return None
    code = worker.process.poll()
    if code is not None:
        return exit_description(code)
    if worker.status is WorkerStatus.READY and now - worker.last_seen > fault.heartbeat_timeout_s:
        return f"hung: no heartbeat for {now - worker.last_seen:.1f} s (fault.heartbeat_timeout_s)"
    if worker.status is not WorkerStatus.READY and now - worker.started_at > fault.start_timeout_s:
        return f"not ready {now - worker.started_at:.0f} s after its restart (fault.start_timeout_s)"
    return None


def stop_failed(worker: WorkerRecord) -> None:
    """Kill the failed worker's process if it still runs, reap it, forget it."""
    if worker.process is not None and worker.process.poll() is None:
        worker.process.kill()
    if worker.process is not None:
        worker.process.wait()
    worker.process = None


def plan_restart(worker: WorkerRecord, reason: str, now: float, fault: FaultConfig) -> None:
    """Record the failure and mark ``worker`` DOWN (past ``fault.max_restarts`` in the
    window) or RESTARTING with its restart time after the back-off."""
    while worker.restarts and now - worker.restarts[0] > fault.restart_window_s:
        worker.restarts.popleft()
    worker.last_failure = reason
    if len(worker.restarts) >= fault.max_restarts:
        worker.status = WorkerStatus.DOWN
        worker.restart_at = None
    else:
        worker.status = WorkerStatus.RESTARTING
        worker.restart_at = now + min(fault.restart_backoff_s * 2 ** len(worker.restarts), MAX_BACKOFF_S)


def failure_notice(key: WorkerKey, worker: WorkerRecord, now: float, fault: FaultConfig,
                   others_serve: bool) -> str:
    """The line printed when ``worker`` failed (after :func:`plan_restart`): what happened and
    what comes next; ``others_serve``: another worker of its role is or will be ready."""
    role, index = key
    if worker.status is WorkerStatus.DOWN:
        rest = "the service runs on the other workers" if others_serve else f"no {role} worker is left: requests get 503"
        plan = (f"it stays down ({len(worker.restarts)} restarts within fault.restart_window_s = "
                f"{fault.restart_window_s:g} s); {rest}")
    else:
        plan = (f"restarting it in {worker.restart_at - now if worker.restart_at else 0:.1f} s "
                f"(restart {len(worker.restarts) + 1} of {fault.max_restarts} allowed in {fault.restart_window_s:g} s)")
    return f"mm-serve: {role} worker {index} {worker.last_failure}; {plan}"
