"""The worker processes of one service instance, their supervision, and what they share with the front end.

Owns: the run directory (sockets, worker logs), the cross-modal rings (one per
(prefill, decode) pair), the sockets (one PUSH per worker for control messages, one
PULL for every worker's reports), the CPU-kernel prebuild, spawning the workers and
waiting until each reports ready, supervision (exits, hangs, restarts with back-off),
health, and shutdown (every worker stopped, every segment unlinked, the run directory
removed). It knows nothing of requests: :class:`~mm_serve.engine.engine_client.EngineClient`
does, and moves the requests of a failed worker elsewhere.

Supervision (:meth:`WorkerPool.supervise`, called by the client's receiver thread
every 0.1 s): a worker that exits (any code) is seen at the next call; a ready worker
that sends nothing for ``fault.heartbeat_timeout_s`` (stats come every
``stats_interval_s`` between steps) is hung, e.g. SIGSTOPped, and is killed. A failed
worker is restarted with the same spec after ``fault.restart_backoff_s`` (doubled for
each restart already in ``fault.restart_window_s``, at most ``MAX_BACKOFF_S``), with a
fresh control socket and fresh ring segments for its pairs; each peer is sent
:class:`~mm_serve.runtime.messages.ReplaceRing`. An old segment is unlinked at once,
unless a peer that is still loading may attach it from its start-up spec: then it is
kept until that peer is ready (and has been told to switch) or has failed. Past
``fault.max_restarts`` restarts in the window a worker stays down and the service runs
on the others.

With ``cluster.backend: ray`` the workers are Ray actors on the nodes the config names
and the sockets are TCP; :class:`~mm_serve.cluster.ray_launch.RayLaunch` supplies what
differs (addresses, which pairs hand off over Ray, the actors), the rest is the same.
"""

from __future__ import annotations

import enum
import re
import shutil
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import zmq

from mm_serve.cluster.kernel_prebuild import BuildStopped, prebuild_cpu_kernels
from mm_serve.cluster.launcher import WorkerProcess, start_worker, stop_workers
from mm_serve.cluster.ring_sizing import ring_specs
from mm_serve.cluster.stale_instances import remove_stale_instances, write_owner
from mm_serve.cluster.worker_specs import build_worker_specs
from mm_serve.config import ServiceConfig
from mm_serve.models.model_config import ModelConfig
from mm_serve.runtime import messages
from mm_serve.runtime.worker_spec import WorkerSpec
from mm_serve.transport.base import HostedRing
from mm_serve.transport.registry import host_ring
from mm_serve.transport.ring_spec import RingSpec

if TYPE_CHECKING:
    from mm_serve.cluster.ray_launch import RayLaunch

WorkerKey = tuple[str, int]  # (role, index)

_GENERATION_SUFFIX = re.compile(r"-r\d+$")
MAX_BACKOFF_S = 10.0  # the doubling back-off never waits longer than this


class WorkerStartError(RuntimeError):
    """A worker exited or did not report ready in time; the message has its log tail."""


class WorkerStatus(str, enum.Enum):
    """What ``/health`` says of one worker."""

    WARMING = "warming"  # first start, not ready yet
    READY = "ready"
    RESTARTING = "restarting"  # failed; waiting for its back-off, or started again and loading
    DOWN = "down"  # failed more than fault.max_restarts times in the window: not restarted


@dataclass
class WorkerFailure:
    """One worker found failed by :meth:`WorkerPool.supervise`."""

    key: WorkerKey
    reason: str  # "exited with code -9", "hung: no heartbeat for 10.2 s", ...
    down: bool  # True when it will not be restarted


@dataclass
class _Worker:
    spec: WorkerSpec
    process: WorkerProcess | None = None
    status: WorkerStatus = WorkerStatus.WARMING
    pid: int = 0
    last_seen: float = 0.0  # monotonic time of its last message
    started_at: float = 0.0
    restart_at: float | None = None  # when to start it again (RESTARTING, not yet started)
    restarts: deque[float] = field(default_factory=deque)  # monotonic times of its restarts
    generation: int = 0
    last_failure: str = ""
    pending: list[msgspec.Struct] = field(default_factory=list)  # control messages for when it is ready


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
        self.ring_specs: list[RingSpec] = []  # every pair's ring, prefill-major (p * M + d)
        self._hosted: dict[int, HostedRing] = {}  # the rings the front end holds (shared memory), by pair
        self._ray: RayLaunch | None = None  # set with cluster.backend: ray
        self.workers: dict[WorkerKey, _Worker] = {}
        self.restart_counts: Counter[str] = Counter()  # role -> restarts so far
        self.stopping = threading.Event()
        self._num_decode = config.compute.decode_workers
        self._ring_generation = 0
        self._retired: list[tuple[HostedRing, set[WorkerKey]]] = []  # old rings a loading peer may attach
        self._ctx: zmq.Context = zmq.Context.instance()  # type: ignore[type-arg]
        self._controls: dict[WorkerKey, zmq.Socket] = {}  # type: ignore[type-arg]
        self._out: zmq.Socket | None = None  # type: ignore[type-arg]
        self._send_lock = threading.RLock()
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
        if cfg.cluster.backend == "ray":
            from mm_serve.cluster.ray_launch import RayLaunch

            self._ray = RayLaunch(cfg, f"mmsrv-{self.instance}")
            m = cfg.compute.decode_workers
            ring_list = [self._ray.ring(r, *divmod(i, m), (0, 0)) for i, r in enumerate(ring_list)]
        self.ring_specs = ring_list
        hosted = {i: host_ring(r) for i, r in enumerate(ring_list)}
        self._hosted = {i: ring for i, ring in hosted.items() if ring is not None}
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(self._ray.bind_address() if self._ray else f"ipc://{self.run_dir}/out")
        output_address = self._out.getsockopt_string(zmq.LAST_ENDPOINT)
        specs = build_worker_specs(self.model_dir, cfg, self.model_config, ring_list, self.run_dir, output_address)
        if self._ray is not None:
            specs = [self._ray.worker_spec(s, ring_list) for s in specs]
        try:
            specs = prebuild_cpu_kernels(specs, self.stopping)
        except BuildStopped as exc:
            raise WorkerStartError(str(exc)) from None
        self.workers = {(s.role, s.index): _Worker(s) for s in specs}
        for key, worker in self.workers.items():
            worker.spec = self._bind_control(key, worker.spec)
        for key in self.workers:
            self._spawn(key)
        self._wait_ready(timeout_s, on_stats)

    def _bind_control(self, key: WorkerKey, spec: WorkerSpec) -> WorkerSpec:
        """Bind worker ``key``'s control socket at ``spec.control_address`` (with Ray: a free
        TCP port); returns the spec with the address as bound."""
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # never mute while the worker is connected: sends do not block
        sock.bind(self._ray.bind_address() if self._ray else spec.control_address)
        old = self._controls.pop(key, None)
        if old is not None:
            old.close(linger=0)
        self._controls[key] = sock
        return msgspec.structs.replace(spec, control_address=sock.getsockopt_string(zmq.LAST_ENDPOINT))

    def _spawn(self, key: WorkerKey) -> None:
        worker = self.workers[key]
        spec = worker.spec
        if self._ray is not None:
            worker.process = self._ray.spawn(spec, worker.generation)
        else:
            worker.process = start_worker(spec, str(self.run_dir / f"{spec.role}{spec.index}.log"))
        worker.pid = worker.process.pid  # 0 for an actor until it has started (see observe)
        worker.started_at = worker.last_seen = time.monotonic()
        worker.restart_at = None

    def _wait_ready(self, timeout_s: float, on_stats: Callable[[messages.WorkerStats], None]) -> None:
        deadline = time.monotonic() + timeout_s
        while any(w.status is not WorkerStatus.READY for w in self.workers.values()):
            if self.stopping.is_set():
                raise WorkerStartError("stopped while the workers were starting")
            for (role, index), worker in self.workers.items():
                code = None if worker.process is None else worker.process.poll()
                if code is not None:
                    raise WorkerStartError(f"{role} worker {index} exited with {code}:\n{self.log_tail()}")
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
    def rings(self) -> list[HostedRing]:
        """The rings the front end holds: the shared-memory rings (every pair's on one machine;
        with Ray, those of pairs on the front end's node), in pair order."""
        return [self._hosted[i] for i in sorted(self._hosted)]

    def ring_transports(self) -> list[str]:
        """Each pair's transport (``shm`` or ``ray``), prefill-major."""
        return [r.transport for r in self.ring_specs]

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
        :meth:`supervise` has not seen it yet): the message is not delivered.
        """
        with self._send_lock:
            worker = self.workers.get(key)
            if worker is None or worker.status is not WorkerStatus.READY:
                return False
            try:
                self._controls[key].send(messages.encode(msg), zmq.NOBLOCK)
            except zmq.Again:
                return False
            return True

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
            with self._send_lock:
                worker.status = WorkerStatus.READY
                pending, worker.pending = worker.pending, []
            for queued in pending:
                self.send((role, index), queued)
            self._release_retired((role, index))
        return True

    def _release_retired(self, key: WorkerKey) -> None:
        """``key`` no longer needs the old rings it may have attached: unlink those nobody waits on."""
        kept = []
        for ring, waiting in self._retired:
            waiting.discard(key)
            if waiting:
                kept.append((ring, waiting))
            else:
                ring.unlink()
        self._retired = kept

    # ---- supervision ---------------------------------------------------------------------------

    def supervise(self) -> list[WorkerFailure]:
        """Find workers that exited or hung since the last call, schedule their restarts, and
        start those whose back-off is over. Returns the failures found now (the caller moves
        their requests elsewhere). Call from one thread (the receiver)."""
        if self.stopping.is_set():
            return []
        cfg = self.config.fault
        now = time.monotonic()
        failures = []
        for key, worker in self.workers.items():
            if worker.status is WorkerStatus.DOWN or worker.process is None:
                continue
            code = worker.process.poll()
            reason = None
            if code is not None:
                reason = f"exited with code {code}"
            elif worker.status is WorkerStatus.READY and now - worker.last_seen > cfg.heartbeat_timeout_s:
                reason = f"hung: no heartbeat for {now - worker.last_seen:.1f} s (fault.heartbeat_timeout_s)"
            elif worker.status is not WorkerStatus.READY and now - worker.started_at > cfg.start_timeout_s:
                reason = f"not ready {now - worker.started_at:.0f} s after its restart (fault.start_timeout_s)"
            if reason is not None:
                failures.append(self._fail(key, reason, now))
        for key, worker in self.workers.items():
            if worker.restart_at is not None and now >= worker.restart_at and not self.stopping.is_set():
                self._restart(key)
        return failures

    def _fail(self, key: WorkerKey, reason: str, now: float) -> WorkerFailure:
        worker = self.workers[key]
        if worker.process is not None and worker.process.poll() is None:
            worker.process.kill()
        if worker.process is not None:
            worker.process.wait()
        worker.process = None
        cfg = self.config.fault
        while worker.restarts and now - worker.restarts[0] > cfg.restart_window_s:
            worker.restarts.popleft()
        with self._send_lock:
            worker.last_failure = reason
            if len(worker.restarts) >= cfg.max_restarts:
                worker.status = WorkerStatus.DOWN
                worker.restart_at = None
            else:
                worker.status = WorkerStatus.RESTARTING
                worker.restart_at = now + min(cfg.restart_backoff_s * 2 ** len(worker.restarts), MAX_BACKOFF_S)
        self._release_retired(key)  # its next start uses the current rings
        role, index = key
        if worker.status is WorkerStatus.DOWN:
            rest = ("the service runs on the other workers" if self.may_recover(role)
                    else f"no {role} worker is left: requests get 503")
            plan = (f"it stays down ({len(worker.restarts)} restarts within fault.restart_window_s = "
                    f"{cfg.restart_window_s:g} s); {rest}")
        else:
            plan = (f"restarting it in {worker.restart_at - now if worker.restart_at else 0:.1f} s "
                    f"(restart {len(worker.restarts) + 1} of {cfg.max_restarts} allowed in {cfg.restart_window_s:g} s)")
        print(f"mm-serve: {role} worker {index} {reason}; {plan}", file=sys.stderr, flush=True)
        return WorkerFailure(key, reason, worker.status is WorkerStatus.DOWN)

    def _restart(self, key: WorkerKey) -> None:
        """Start a failed worker again: fresh control socket, fresh rings for its pairs."""
        worker = self.workers[key]
        worker.generation += 1
        worker.restarts.append(time.monotonic())
        self.restart_counts[key[0]] += 1
        role, index = key
        tag = f"{role[0]}{index}-g{worker.generation}"
        spec = msgspec.structs.replace(worker.spec, control_address=f"ipc://{self.run_dir}/ctl-{tag}")
        if role in ("prefill", "decode"):
            spec = msgspec.structs.replace(spec, rings=self._replace_rings(role, index))
        worker.spec = self._bind_control(key, spec)
        worker.pending = []  # its spec has the current rings
        self._spawn(key)

    def _replace_rings(self, role: str, index: int) -> list[RingSpec]:
        """New segments for every ring of worker (``role``, ``index``), the old ones unlinked;
        each peer is told to switch. Returns the worker's rings in its order."""
        m = self._num_decode
        pairs = ([index * m + d for d in range(m)] if role == "prefill"
                 else [p * m + index for p in range(len(self.ring_specs) // m)])
        self._ring_generation += 1
        out = []
        for ring_index in pairs:
            p, d = divmod(ring_index, m)
            base = _GENERATION_SUFFIX.sub("", self.ring_specs[ring_index].name)
            new_spec = msgspec.structs.replace(self.ring_specs[ring_index], name=f"{base}-r{self._ring_generation}")
            if self._ray is not None:  # over Ray: the actor names of this generation
                gens = (self.workers[("prefill", p)].generation, self.workers[("decode", d)].generation)
                new_spec = self._ray.ring(new_spec, p, d, gens)
            self.ring_specs[ring_index] = new_spec
            old = self._hosted.pop(ring_index, None)
            hosted = host_ring(new_spec)
            if hosted is not None:
                self._hosted[ring_index] = hosted
            out.append(new_spec)
            peer_key, peer_index = (("decode", d), p) if role == "prefill" else (("prefill", p), d)
            peer = self.workers[peer_key]
            if old is not None:
                old.close()
                if peer.status is not WorkerStatus.READY and peer.process is not None:
                    self._retired.append((old, {peer_key}))  # it may attach the old ring while it loads
                else:
                    old.unlink()
            self._tell_peer(peer_key, messages.ReplaceRing(peer_index, new_spec))
        return out

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

    # ---- health ----------------------------------------------------------------------------------

    @property
    def is_ready(self) -> bool:
        """Whether at least one path can serve (one prefill and one decode, or one colocated, ready)."""
        if not self.workers or self.stopping.is_set():
            return False
        if self.colocated:
            return bool(self.ready_indices("colocated"))
        return bool(self.ready_indices("prefill")) and bool(self.ready_indices("decode"))

    def health(self) -> dict[str, object]:
        """``status`` (``ok``: every worker ready; ``degraded``: some are not but a path serves;
        ``warming``: the first start is under way; ``down``: no path serves), per-worker
        ``workers`` (``ready | warming | restarting | down``) and ``faults`` (the last failure
        of each worker that had one)."""
        workers = {f"{r}{i}": w.status.value for (r, i), w in self.workers.items()}
        faults = {f"{r}{i}": w.last_failure for (r, i), w in self.workers.items() if w.last_failure}
        if workers and all(v == "ready" for v in workers.values()):
            status = "ok"
        elif self.is_ready:
            status = "degraded"
        elif workers and all(w.status is WorkerStatus.WARMING or w.status is WorkerStatus.READY
                             for w in self.workers.values()) and not faults:
            status = "warming"
        else:
            status = "down"
        return {"status": status, "workers": workers, "faults": faults}

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
        with self._send_lock:
            for sock in self._controls.values():
                try:
                    sock.send(messages.encode(messages.Shutdown()), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        stop_workers(self.processes)
        if self._ray is not None:
            self._ray.close()
        for ring in self.rings:
            ring.close()
            ring.unlink()
        for ring, _ in self._retired:
            ring.unlink()
        self._retired = []
        with self._send_lock:
            for sock in self._controls.values():
                sock.close(linger=0)
        if self._out is not None:
            self._out.close(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)


_DECODER = messages.decoder(messages.FromWorker)
