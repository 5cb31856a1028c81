"""The worker processes of one service instance and everything they share with the front end.

Owns: the run directory (sockets, worker logs), the cross-modal rings (one per
(prefill, decode) pair), the sockets (one PUSH per worker for control messages, one
PULL for every worker's reports), the CPU-kernel prebuild, spawning the workers and
waiting until each reports ready, their exit codes, health, and shutdown (every worker
stopped, every segment unlinked, the run directory removed). It knows nothing of
requests: :class:`~mm_serve.engine.engine_client.EngineClient` does.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kernels.ring_buffer import CrossModalRing
from mm_serve.config import ServiceConfig
from mm_serve.engine.kernel_prebuild import BuildStopped, prebuild_cpu_kernels
from mm_serve.engine.ring_sizing import ring_specs
from mm_serve.engine.stale_instances import remove_stale_instances, write_owner
from mm_serve.engine.worker_specs import build_worker_specs
from mm_serve.launcher import start_worker, stop_workers
from mm_serve.models.model_config import ModelConfig
from mm_serve.runtime import messages
from mm_serve.runtime.worker_spec import WorkerSpec

WorkerKey = tuple[str, int]  # (role, index)


class WorkerStartError(RuntimeError):
    """A worker exited or did not report ready in time; the message has its log tail."""


class WorkerPool:
    """Rings, sockets and processes of the N prefill + M decode (or one colocated) workers."""

    def __init__(self, model_dir: Path, config: ServiceConfig, model_config: ModelConfig) -> None:
        self.model_dir = model_dir
        self.config = config
        self.model_config = model_config
        self.instance = uuid.uuid4().hex[:12]
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"mmsrv-{self.instance}-"))
        write_owner(self.run_dir)
        # removed by shutdown(); also when a pool that never started is dropped, or at exit
        weakref.finalize(self, shutil.rmtree, str(self.run_dir), True)
        self.colocated = config.mode == "colocated"
        self.rings: list[CrossModalRing] = []
        self.specs: list[WorkerSpec] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        self.ready: set[WorkerKey] = set()
        self.dead: dict[WorkerKey, int] = {}  # exit code of each worker that exited unexpectedly
        self.stopping = threading.Event()
        self._ctx: zmq.Context = zmq.Context.instance()  # type: ignore[type-arg]
        self._controls: dict[WorkerKey, zmq.Socket] = {}  # type: ignore[type-arg]
        self._out: zmq.Socket | None = None  # type: ignore[type-arg]
        self._send_lock = threading.Lock()
        self._closed = False
        self._close_lock = threading.Lock()

    # ---- start-up ------------------------------------------------------------------------------

    def start(self, timeout_s: float, on_stats: Callable[[messages.WorkerStats], None]) -> None:
        """Create rings, bind sockets, spawn every worker, wait until each is ready.

        ``on_stats`` receives the stats reports that arrive while waiting.

        Raises:
            WorkerStartError: a worker died or timed out, or :meth:`request_stop` was called.
        """
        cfg = self.config
        stale = remove_stale_instances()
        if stale:
            print(f"mm-serve: removed the run directories and shared memory of {len(stale)} stopped "
                  f"instance(s) whose process is gone: {', '.join(stale)}", file=sys.stderr, flush=True)
        ring_list = [] if self.colocated else ring_specs(self.instance, cfg, self.model_config)
        self.rings = [CrossModalRing.create(s) for s in ring_list]
        self._out = self._ctx.socket(zmq.PULL)
        output_address = f"ipc://{self.run_dir}/out"
        self._out.bind(output_address)
        specs = build_worker_specs(self.model_dir, cfg, self.model_config, ring_list, self.run_dir, output_address)
        try:
            self.specs = prebuild_cpu_kernels(specs, self.stopping)
        except BuildStopped as exc:
            raise WorkerStartError(str(exc)) from None
        for spec in self.specs:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(spec.control_address)
            self._controls[(spec.role, spec.index)] = sock
        for spec in self.specs:
            self.processes.append(start_worker(spec, str(self.run_dir / f"{spec.role}{spec.index}.log")))
        self._wait_ready(timeout_s, on_stats)

    def _wait_ready(self, timeout_s: float, on_stats: Callable[[messages.WorkerStats], None]) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.ready) < len(self.specs):
            if self.stopping.is_set():
                raise WorkerStartError("stopped while the workers were starting")
            for role, index, code in self.reap():
                raise WorkerStartError(f"{role} worker {index} exited with {code}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise WorkerStartError(f"workers not ready after {timeout_s:.0f} s:\n{self.log_tail()}")
            msg = self.recv(200)
            if isinstance(msg, messages.WorkerReady):
                self.ready.add((msg.role, msg.index))
            elif isinstance(msg, messages.WorkerStats):
                on_stats(msg)

    # ---- running -------------------------------------------------------------------------------

    @property
    def keys(self) -> list[WorkerKey]:
        return list(self._controls)

    def num_workers(self, *roles: str) -> int:
        """How many workers have one of ``roles``."""
        return sum(1 for s in self.specs if s.role in roles)

    def send(self, key: WorkerKey, msg: msgspec.Struct) -> None:
        """Queue a control message for worker ``key`` (thread-safe)."""
        with self._send_lock:
            self._controls[key].send(messages.encode(msg))

    def recv(self, timeout_ms: int) -> object | None:
        """The next report from any worker, waiting up to ``timeout_ms``; None on timeout or an
        undecodable frame. One thread at a time (the start-up wait, then the receiver thread)."""
        assert self._out is not None, "recv before start"
        if not self._out.poll(timeout_ms):
            return None
        try:
            return _DECODER.decode(self._out.recv())
        except msgspec.DecodeError:
            return None

    def reap(self) -> list[tuple[str, int, int]]:
        """``(role, index, exit code)`` of each worker that exited since the last call (not
        counting exits during shutdown); they are recorded in :attr:`dead`."""
        out = []
        for spec, proc in zip(self.specs, self.processes, strict=False):
            code = proc.poll()
            key = (spec.role, spec.index)
            if code is not None and key not in self.dead and not self.stopping.is_set():
                self.dead[key] = code
                out.append((spec.role, spec.index, code))
        return out

    @property
    def is_ready(self) -> bool:
        return bool(self.specs) and len(self.ready) == len(self.specs) and not self.dead and not self.stopping.is_set()

    def health(self) -> dict[str, Any]:
        """Per-worker status: ``ready``, ``warming`` or ``down (exit N)``; ``ok`` when all are ready."""
        workers = {}
        for spec in self.specs:
            key = (spec.role, spec.index)
            if key in self.dead:
                status = f"down (exit {self.dead[key]})"
            else:
                status = "ready" if key in self.ready else "warming"
            workers[f"{spec.role}{spec.index}"] = status
        return {"ok": bool(workers) and all(v == "ready" for v in workers.values()), "workers": workers}

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of every worker's log."""
        out = []
        for log in sorted(self.run_dir.glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(out)

    # ---- shutdown ------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Make a concurrent :meth:`start` give up (cleanup is :meth:`shutdown`)."""
        self.stopping.set()

    def shutdown(self) -> None:
        """Stop every worker, unlink every ring segment, close the sockets, remove the run
        directory. Idempotent; safe after a failed :meth:`start`."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.stopping.set()
        for sock in self._controls.values():
            try:
                sock.send(messages.encode(messages.Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        stop_workers(self.processes)
        for ring in self.rings:
            ring.close()
            ring.unlink()
        for sock in self._controls.values():
            sock.close(linger=0)
        if self._out is not None:
            self._out.close(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)


_DECODER = messages.decoder(messages.FromWorker)
