"""The worker processes of one service instance and the sockets to them.

Owns the run directory (``ipc://`` sockets, worker logs), the sockets
(:class:`~mm_serve.cluster.control_sockets.ControlSockets`), one
:class:`~mm_serve.cluster.worker_state.WorkerRecord` per worker, spawning (a local
process, or a Ray actor through :class:`~mm_serve.cluster.ray_launch.RayLaunch`), the
wait until every worker reports ready, the heartbeat and readiness book-keeping of each
report, and stopping everything. :class:`~mm_serve.cluster.worker_pool.WorkerPool`
builds on it with the rings and supervision.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from mm_serve.cluster.control_sockets import ControlSockets
from mm_serve.cluster.launcher import WorkerProcess, start_worker, stop_workers
from mm_serve.cluster.stale_instances import write_owner
from mm_serve.cluster.worker_state import (
    USER_ERROR_EXIT,
    WorkerKey,
    WorkerRecord,
    WorkerStartError,
    WorkerStatus,
    exit_description,
)
from mm_serve.ground.console import say
from mm_serve.runtime import messages
from mm_serve.runtime.worker_spec import WorkerSpec

if TYPE_CHECKING:
    from mm_serve.cluster.ray_launch import RayLaunch


class WorkerProcesses:
    """Processes (or actors), records and sockets of the workers of one instance.

    Thread safety: :meth:`send` from any thread; :meth:`recv` and :meth:`observe` from one
    thread at a time (the start-up wait, then the client's receiver thread).
    """

    def __init__(self) -> None:
        self.instance = uuid.uuid4().hex[:12]
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"mmsrv-{self.instance}-"))
        write_owner(self.run_dir)
        # removed by shutdown(); also when a pool that never started is dropped, or at exit
        weakref.finalize(self, shutil.rmtree, str(self.run_dir), True)
        self.workers: dict[WorkerKey, WorkerRecord] = {}
        self.stopping = threading.Event()
        self._ray: RayLaunch | None = None  # set with cluster.backend: ray
        self._sockets = ControlSockets()
        self._send_lock = threading.RLock()

    # ---- start-up ------------------------------------------------------------------------------

    def _bind_reports(self) -> str:
        """Bind the report socket (run directory, or a free TCP port with Ray); its address."""
        return self._sockets.bind_reports(self._ray.bind_address() if self._ray else f"ipc://{self.run_dir}/out")

    def _bind_control(self, key: WorkerKey, spec: WorkerSpec) -> WorkerSpec:
        """Bind worker ``key``'s control socket at ``spec.control_address`` (with Ray: a free
        TCP port); returns the spec with the address as bound."""
        bound = self._sockets.bind_control(key, self._ray.bind_address() if self._ray else spec.control_address)
        return msgspec.structs.replace(spec, control_address=bound)

    def _spawn(self, key: WorkerKey) -> None:
        """Start worker ``key`` from its current spec (and generation, with Ray)."""
        worker = self.workers[key]
        spec = worker.spec
        if self._ray is not None:
            worker.process = self._ray.spawn(spec, worker.generation)
        else:
            worker.process = start_worker(spec, str(self._log_path(key)))
        worker.pid = worker.process.pid  # 0 for an actor until it has started (see observe)
        worker.started_at = worker.last_seen = time.monotonic()
        worker.restart_at = None

    def _wait_ready(self, timeout_s: float, on_stats: Callable[[messages.WorkerStats], None]) -> None:
        """Read reports until every worker is ready; ``on_stats`` gets the stats among them.

        Raises:
            WorkerStartError: a worker exited, ``timeout_s`` passed, or a stop was requested.
        """
        deadline = time.monotonic() + timeout_s
        while any(w.status is not WorkerStatus.READY for w in self.workers.values()):
            if self.stopping.is_set():
                raise WorkerStartError("stopped while the workers were starting")
            for (role, index), worker in self.workers.items():
                code = None if worker.process is None else worker.process.poll()
                if code == USER_ERROR_EXIT and (said := self._error_line((role, index))) is not None:
                    raise WorkerStartError(said, user_error=True)  # the checkpoint: its one line, not a log tail
                if code is not None:
                    raise WorkerStartError(f"{role} worker {index} {exit_description(code)}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise WorkerStartError(f"workers not ready after {timeout_s:.0f} s:\n{self.log_tail()}")
            msg = self.recv(200)
            if msg is not None and self.observe(msg) and isinstance(msg, messages.WorkerStats):
                on_stats(msg)

    # ---- running -------------------------------------------------------------------------------

    @property
    def keys(self) -> list[WorkerKey]:
        return list(self.workers)

    @property
    def specs(self) -> list[WorkerSpec]:
        """The current spec of every worker, in start order."""
        return [w.spec for w in self.workers.values()]

    @property
    def processes(self) -> list[WorkerProcess]:
        """The current process of every worker that has one."""
        return [w.process for w in self.workers.values() if w.process is not None]

    def num_workers(self, *roles: str) -> int:
        """How many workers have one of ``roles``."""
        return sum(1 for role, _ in self.workers if role in roles)

    def ready_indices(self, *roles: str) -> list[int]:
        """Indices of the ready workers of ``roles``."""
        return [i for (role, i), w in self.workers.items() if role in roles and w.status is WorkerStatus.READY]

    def may_recover(self, *roles: str) -> bool:
        """Whether a worker of ``roles`` is ready or will be (warming or restarting, not down)."""
        return any(role in roles and w.status is not WorkerStatus.DOWN for (role, _), w in self.workers.items())

    def status(self, key: WorkerKey) -> WorkerStatus:
        return self.workers[key].status

    def send(self, key: WorkerKey, msg: msgspec.Struct) -> bool:
        """Queue a control message for worker ``key`` (thread-safe, never blocks).

        Returns False when the worker is not ready or its socket has no peer (it died and
        supervision has not seen it yet): the message is not delivered.
        """
        with self._send_lock:
            worker = self.workers.get(key)
            if worker is None or worker.status is not WorkerStatus.READY:
                return False
            return self._sockets.send(key, msg)

    def recv(self, timeout_ms: int) -> object | None:
        """The next report from any worker, waiting up to ``timeout_ms``; None on timeout or an
        undecodable frame.

        Raises:
            RuntimeError: before the report socket is bound (by ``start``).
        """
        return self._sockets.recv(timeout_ms)

    def observe(self, msg: object) -> bool:
        """Book-keeping for one report: heartbeat, readiness. Returns False for a report of
        a process that is no longer the worker's (sent before it was replaced): drop it."""
        role, index = getattr(msg, "role", None), getattr(msg, "index", None)
        if role is None or index is None:
            return True
        worker = self.workers.get((role, index))
        if worker is None:
            return False
        if not worker.pid and worker.process is not None:
            worker.pid = worker.process.pid  # an actor's pid, once it has started
        pid = getattr(msg, "pid", None)
        if pid is not None and worker.pid and pid != worker.pid:
            return False
        worker.last_seen = time.monotonic()
        if isinstance(msg, messages.WorkerReady) and worker.status is not WorkerStatus.READY:
            if msg.warm_up_error:
                say(f"mm-serve: {getattr(role, 'value', role)} worker {index}: warm-up pass failed, serving without it "
                    f"(its first requests pay the lazy initialisation): {msg.warm_up_error}")
            with self._send_lock:
                worker.status = WorkerStatus.READY
                pending, worker.pending = worker.pending, []
            for queued in pending:
                self.send((role, index), queued)
            self._on_ready((role, index))
        return True

    def _on_ready(self, key: WorkerKey) -> None:
        """Worker ``key`` just reported ready (after its queued messages went out)."""

    def _log_path(self, key: WorkerKey) -> Path:
        """Where worker ``key`` writes its output (``decode0.log``)."""
        role, index = key
        return self.run_dir / f"{role}{index}.log"

    def _error_line(self, key: WorkerKey) -> str | None:
        """The ``error: ...`` line worker ``key`` wrote last in its log before exiting with
        :data:`USER_ERROR_EXIT` (without the prefix); None when there is none."""
        try:
            lines = self._log_path(key).read_text(errors="replace").splitlines()
        except OSError:
            return None
        said = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
        return said[-1] if said else None

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of every worker's log."""
        out = []
        for log in sorted(self.run_dir.glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(out)

    # ---- shutdown ------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Make a concurrent start give up (cleanup is ``shutdown``)."""
        self.stopping.set()

    def _stop_workers(self) -> None:
        """Tell every worker to shut down, then stop every process (and leave Ray). A worker still loading
        (a first start or a restart) is killed at once: it holds no request, and the Shutdown is dropped
        for one that has not connected its control socket yet, so a stop waited out the 10 s for it."""
        self.stopping.set()
        with self._send_lock:
            self._sockets.broadcast_shutdown()
        for worker in self.workers.values():
            if worker.loading and worker.process is not None:
                worker.process.kill()
        stop_workers(self.processes)
        if self._ray is not None:
            self._ray.close()

    def _close_sockets_and_run_dir(self) -> None:
        with self._send_lock:
            self._sockets.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)
