"""The workers of one service instance: their processes, rings and supervision.

Owns, beyond the processes and sockets of
:class:`~mm_serve.cluster.worker_processes.WorkerProcesses`: the hand-off rings
(:class:`~mm_serve.cluster.ring_generations.RingGenerations`: one per (prefill, decode)
pair), the CPU-kernel prebuild, the start-up, supervision
(:mod:`~mm_serve.cluster.supervision`: exits, hangs, restarts with back-off), health, and
shutdown (every worker stopped, every segment unlinked, the run directory removed). It
knows nothing of requests: :class:`~mm_serve.engine.engine_client.EngineClient` does, and
moves the requests of a failed worker elsewhere.

Supervision (:meth:`WorkerPool.supervise`, called by the client's receiver thread every
0.1 s) finds failed workers and restarts each with the same spec after its back-off, with a
fresh control socket and fresh rings for its pairs; each peer is sent
:class:`~mm_serve.runtime.messages.ReplaceRing`.

With ``cluster.backend: ray`` the workers are Ray actors on the nodes the config names
and the sockets are TCP; :class:`~mm_serve.cluster.ray_launch.RayLaunch` supplies what
differs (addresses, which pairs hand off over Ray, the actors), the rest is the same.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgspec

from mm_serve.cluster import supervision
from mm_serve.cluster.host_memory import check_host_memory
from mm_serve.cluster.kernel_prebuild import BuildStopped, prebuild_cpu_kernels
from mm_serve.cluster.ring_generations import RingGenerations
from mm_serve.cluster.ring_sizing import ring_specs
from mm_serve.cluster.stale_instances import remove_stale_instances
from mm_serve.cluster.worker_processes import WorkerProcesses
from mm_serve.cluster.worker_specs import build_worker_specs
from mm_serve.cluster.worker_state import (
    WorkerFailure,
    WorkerKey,
    WorkerRecord,
    WorkerStartError,
    WorkerStatus,
    health_report,
)
from mm_serve.config import ServiceConfig
from mm_serve.ground.console import say
from mm_serve.ground.roles import Role
from mm_serve.models.model_config import ModelConfig
from mm_serve.runtime import messages
from mm_serve.transport.base import HostedRing
from mm_serve.transport.ring_spec import RingSpec

__all__ = ["WorkerFailure", "WorkerKey", "WorkerPool", "WorkerStartError", "WorkerStatus"]


class WorkerPool(WorkerProcesses):
    """Rings, sockets and processes of the N prefill + M decode (or one colocated) workers."""

    def __init__(self, model_dir: Path, config: ServiceConfig, model_config: ModelConfig) -> None:
        super().__init__()
        self.model_dir = model_dir
        self.config = config
        self.model_config = model_config
        self.colocated = config.mode == "colocated"
        self._rings = RingGenerations([], config.compute.decode_workers)
        self.restart_counts: Counter[str] = Counter()  # role -> restarts so far
        self._closed = False
        self._close_lock = threading.Lock()

    def start(self, timeout_s: float, on_stats: Callable[[messages.WorkerStats], None]) -> None:
        """Create rings, bind sockets, spawn every worker, wait until each is ready.

        ``on_stats`` receives the stats reports that arrive while waiting.

        Raises:
            WorkerStartError: a worker died or timed out, or :meth:`request_stop` was called.
        """
        cfg = self.config
        stale = remove_stale_instances()
        if stale:
            say(f"mm-serve: removed the run directories and shared memory of {len(stale)} stopped "
                f"instance(s) whose process is gone: {', '.join(stale)}")
        ring_list = [] if self.colocated else ring_specs(self.instance, cfg, self.model_config)
        if cfg.cluster.backend == "local":  # with Ray the workers' memory is their nodes'
            check_host_memory(cfg, self.model_config, ring_list)
        if cfg.cluster.backend == "ray":
            from mm_serve.cluster.ray_launch import RayLaunch

            self._ray = RayLaunch(cfg, f"mmsrv-{self.instance}")
            m = cfg.compute.decode_workers
            ring_list = [self._ray.ring(r, *divmod(i, m), (0, 0)) for i, r in enumerate(ring_list)]
        self._rings = RingGenerations(ring_list, cfg.compute.decode_workers)
        output_address = self._bind_reports()
        specs = build_worker_specs(self.model_dir, cfg, self.model_config, ring_list, self.run_dir, output_address)
        if self._ray is not None:
            specs = [self._ray.worker_spec(s, ring_list) for s in specs]
        try:
            specs = prebuild_cpu_kernels(specs, self.stopping)
        except BuildStopped as exc:
            raise WorkerStartError(str(exc)) from None
        self.workers = {(s.role, s.index): WorkerRecord(s) for s in specs}
        for key, worker in self.workers.items():
            worker.spec = self._bind_control(key, worker.spec)
        for key in self.workers:
            self._spawn(key)
        self._wait_ready(timeout_s, on_stats)

    # ---- rings ---------------------------------------------------------------------------------

    @property
    def ring_specs(self) -> list[RingSpec]:
        """Every pair's current ring spec, prefill-major (``p * M + d``)."""
        return self._rings.specs

    @property
    def rings(self) -> list[HostedRing]:
        """The rings the front end hosts (shared memory: every pair's on one machine; with Ray,
        those of pairs on the front end's node), in pair order."""
        return self._rings.rings

    def ring_transports(self) -> list[str]:
        """Each pair's transport (``shm`` or ``ray``), prefill-major."""
        return self._rings.transports()

    def _on_ready(self, key: WorkerKey) -> None:
        self._rings.release(key)  # it has switched to the current rings: the old ones may go

    # ---- supervision ---------------------------------------------------------------------------

    def supervise(self) -> list[WorkerFailure]:
        """Find workers that exited or hung since the last call, schedule their restarts, and
        start those whose back-off is over. Returns the failures found now (the caller moves
        their requests elsewhere). Call from one thread (the receiver)."""
        if self.stopping.is_set():
            return []
        now = time.monotonic()
        failures = []
        for key, worker in self.workers.items():
            reason = supervision.failure_reason(worker, now, self.config.fault)
            if reason is not None:
                failures.append(self._fail(key, reason, now))
        for key, worker in self.workers.items():
            if worker.restart_at is not None and now >= worker.restart_at and not self.stopping.is_set():
                self._restart(key)
        return failures

    def _fail(self, key: WorkerKey, reason: str, now: float) -> WorkerFailure:
        worker = self.workers[key]
        supervision.stop_failed(worker)
        with self._send_lock:
            supervision.plan_restart(worker, reason, now, self.config.fault)
        self._rings.release(key)  # its next start uses the current rings
        others = self.may_recover(key[0])
        say(supervision.failure_notice(key, worker, now, self.config.fault, others))
        return WorkerFailure(key, reason, worker.status is WorkerStatus.DOWN)

    def _restart(self, key: WorkerKey) -> None:
        """Start a failed worker again: fresh control socket, fresh rings for its pairs."""
        worker = self.workers[key]
        worker.generation += 1
        worker.restarts.append(time.monotonic())
        self.restart_counts[key[0]] += 1
        role = worker.spec.role
        tag = f"{role.value[0]}{key[1]}-g{worker.generation}"
        spec = msgspec.structs.replace(worker.spec, control_address=f"ipc://{self.run_dir}/ctl-{tag}")
        if role.hands_off:
            rings, swaps = self._rings.renew(key, self._respec, lambda peer: self.workers[peer].loading)
            spec = msgspec.structs.replace(spec, rings=rings)
            for swap in swaps:
                self._tell_peer(swap.peer, swap.message)
        worker.spec = self._bind_control(key, spec)
        worker.pending = []  # its spec has the current rings
        self._spawn(key)

    def _respec(self, spec: RingSpec, p: int, d: int) -> RingSpec:
        """Pair (``p``, ``d``)'s fresh ring spec; over Ray, naming the actors of this generation."""
        if self._ray is None:
            return spec
        gens = (self.workers[(Role.PREFILL, p)].generation, self.workers[(Role.DECODE, d)].generation)
        return self._ray.ring(spec, p, d, gens)

    def _tell_peer(self, key: WorkerKey, msg: messages.ReplaceRing) -> None:
        """Deliver a ring swap to a peer now, or when it is ready; a peer not started yet gets
        the new ring in its spec instead."""
        peer = self.workers[key]
        rings = list(peer.spec.rings)
        rings[msg.peer_index] = msg.ring
        with self._send_lock:
            peer.spec = msgspec.structs.replace(peer.spec, rings=rings)
            if peer.status is WorkerStatus.READY:
                if not self.send(key, msg):
                    peer.pending.append(msg)  # it died: its own restart uses the spec above
            elif peer.process is not None:  # loading: it may have attached the old ring already
                peer.pending.append(msg)

    # ---- health and shutdown -------------------------------------------------------------------

    @property
    def is_ready(self) -> bool:
        """Whether at least one path can serve (one prefill and one decode, or one colocated, ready)."""
        if not self.workers or self.stopping.is_set():
            return False
        if self.colocated:
            return bool(self.ready_indices(Role.COLOCATED))
        return bool(self.ready_indices(Role.PREFILL)) and bool(self.ready_indices(Role.DECODE))

    def health(self) -> dict[str, object]:
        """Service and per-worker status (see :func:`~mm_serve.cluster.worker_state.health_report`)."""
        return health_report(self.workers, self.is_ready)

    def shutdown(self) -> None:
        """Stop every worker, unlink every ring segment, close the sockets, remove the run
        directory. Idempotent; safe after a failed :meth:`start`."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stop_workers()
        self._rings.close()
        self._close_sockets_and_run_dir()
