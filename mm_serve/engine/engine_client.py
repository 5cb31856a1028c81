"""The front end's handle on the worker processes (disaggregated or colocated).

Start-up: create one cross-modal ring per (prefill, decode) pair, bind the
sockets, spawn the workers, wait until each reports ready. Then
:meth:`EngineClient.submit` routes requests (see :mod:`mm_serve.router`), a
receiver thread assembles token updates into :class:`RequestState` s, and
:meth:`EngineClient.shutdown` stops every worker and unlinks every segment.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kernels.ring_buffer import CrossModalRing
from mm_serve import messages
from mm_serve.config import ServiceConfig
from mm_serve.engine.input_processor import InputProcessor, InvalidRequestError, ProcessedInputs
from mm_serve.engine.request_state import RequestState
from mm_serve.engine.ring_sizing import ring_specs
from mm_serve.engine.sampling_wire import to_wire
from mm_serve.engine.worker_setup import engine_config_from_sizing
from mm_serve.engine.worker_specs import build_worker_specs, check_supported
from mm_serve.launcher import start_worker, stop_workers
from mm_serve.models.model_config import load_model_config
from mm_serve.router import Router
from mm_serve.sampling_params import SamplingParams
from text_decode.detokenizer import IncrementalDetokenizer
from text_decode.kv_cache import pages_for


class WorkerStartError(RuntimeError):
    """A worker exited or did not report ready in time; the message has its log tail."""


CPU_KERNEL_BUILD_TIMEOUT_S = 300.0  # a normal build takes ~15 s on 2 cores


class EngineClient:
    """Owns the workers, the rings and the sockets of one service instance."""

    def __init__(self, model_dir: str | Path, config: ServiceConfig, inputs: InputProcessor | None = None) -> None:
        check_supported(config)
        self.model_dir = Path(model_dir)
        self.config = config
        self.model_config = load_model_config(self.model_dir)
        self.inputs = inputs or InputProcessor(self.model_dir, self.model_config)
        self.instance = uuid.uuid4().hex[:12]
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"mmsrv-{self.instance}-"))
        # removed by shutdown(); also when a client that never started is dropped, or at exit
        weakref.finalize(self, shutil.rmtree, str(self.run_dir), True)
        self.colocated = config.mode == "colocated"
        self.max_model_len = self.model_config.text.max_position_embeddings
        eos = set(self.model_config.text.eos_token_ids)
        if self.inputs.tokenizer.eos_token_id is not None:
            eos.add(int(self.inputs.tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self.rings: list[CrossModalRing] = []
        self.processes: list[Any] = []
        self.stats: dict[tuple[str, int], messages.WorkerStats] = {}
        self.ready: dict[tuple[str, int], bool] = {}
        self.dead: dict[tuple[str, int], int] = {}
        self.requests: dict[str, RequestState] = {}
        self._lock = threading.RLock()
        self._ctx: zmq.Context = zmq.Context.instance()  # type: ignore[type-arg]
        self._stopping = threading.Event()
        self._closed = False
        self._close_lock = threading.Lock()
        self._seed_rng = random.Random(config.seed)
        self._receiver: threading.Thread | None = None
        self._stats_time: dict[tuple[str, int], float] = {}
        self.finish_listeners: list[Callable[[RequestState], None]] = []  # called on the receiver thread
        self.specs: list[Any] = []
        self.router: Router | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self, timeout_s: float = 600.0) -> None:
        """Create rings, spawn workers, wait for all of them to be ready.

        Raises:
            WorkerStartError: a worker died or timed out during start-up (everything is cleaned up).
        """
        try:
            self._start(timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, timeout_s: float) -> None:
        cfg = self.config
        specs = [] if self.colocated else ring_specs(self.instance, cfg, self.model_config)
        self.rings = [CrossModalRing.create(s) for s in specs]
        self._out = self._ctx.socket(zmq.PULL)
        output_address = f"ipc://{self.run_dir}/out"
        self._out.bind(output_address)
        self.specs = build_worker_specs(self.model_dir, cfg, self.model_config, specs, self.run_dir, output_address)
        self._prebuild_cpu_kernels()
        self._controls: dict[tuple[str, int], zmq.Socket] = {}
        self._send_lock = threading.Lock()
        for spec in self.specs:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(spec.control_address)
            self._controls[(spec.role, spec.index)] = sock
        for spec in self.specs:
            self.processes.append(start_worker(spec, str(self.run_dir / f"{spec.role}{spec.index}.log")))
        decoders = [s for s in self.specs if s.role in ("decode", "colocated")]
        self.router = Router(
            len([s for s in self.specs if s.role in ("prefill", "colocated")]), len(decoders),
            cfg.kv_cache.max_pages_per_gpu, cfg.scheduler.decode_max_concurrent,
        )
        self._wait_ready(timeout_s)
        self._receiver = threading.Thread(target=self._receive_loop, name="mm-serve-receiver", daemon=True)
        self._receiver.start()

    def _prebuild_cpu_kernels(self) -> None:
        """Build the compiled CPU kernels (:mod:`kernels.cpu_extension`) before CPU workers start.

        Workers log to files; building here, in a child process of this one, puts the build
        message or the fallback warning on this process's terminal, once, and lets a stop
        request kill the compiler with it (its own process group). If the build fails,
        workers run ``cpu_kernels: torch`` instead of each failing the same way.
        """
        wanted = [engine_config_from_sizing(s.sizing).compiled_cpu_kernels for s in self.specs]
        if not any(wanted):
            return
        from kernels.cpu_extension import is_built

        try:
            if is_built():
                return
        except OSError:
            pass  # sources missing or unreadable: the child says so, workers use torch kernels
        build = subprocess.Popen([sys.executable, "-m", "kernels.cpu_extension"], start_new_session=True)
        deadline = time.monotonic() + CPU_KERNEL_BUILD_TIMEOUT_S
        try:
            while build.poll() is None:
                if self._stopping.is_set():
                    raise WorkerStartError("stopped while the workers were starting")
                if time.monotonic() > deadline:  # a hung compiler, or another build stopped holding the lock
                    print(f"mm-serve: warning: building the CPU kernels took over {CPU_KERNEL_BUILD_TIMEOUT_S:.0f} s; "
                          "stopped it, workers use the torch kernels", file=sys.stderr, flush=True)
                    break
                time.sleep(0.1)
        finally:
            if build.poll() is None:
                # SIGTERM first: ninja runs each compiler in a process group of its own and
                # stops them itself when it is told to stop, which SIGKILL would not let it do.
                os.killpg(build.pid, signal.SIGTERM)
                try:
                    build.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    os.killpg(build.pid, signal.SIGKILL)
                    build.wait()
        if build.returncode is not None and build.returncode < 0 and time.monotonic() <= deadline:
            print(f"mm-serve: warning: building the CPU kernels was killed (signal {-build.returncode}); "
                  "workers use the torch kernels", file=sys.stderr, flush=True)
        if build.returncode != 0:
            replace = msgspec.structs.replace
            self.specs = [replace(s, sizing=replace(s.sizing, cpu_kernels="torch")) if w else s
                          for s, w in zip(self.specs, wanted, strict=True)]

    def _wait_ready(self, timeout_s: float) -> None:
        decoder = messages.decoder(messages.FromWorker)
        deadline = time.monotonic() + timeout_s
        while len(self.ready) < len(self.specs):
            if self._stopping.is_set():
                raise WorkerStartError("stopped while the workers were starting")
            self._check_processes(raise_on_death=True)
            if time.monotonic() > deadline:
                raise WorkerStartError(f"workers not ready after {timeout_s:.0f} s:\n{self.log_tail()}")
            if self._out.poll(200):
                msg = decoder.decode(self._out.recv())
                if isinstance(msg, messages.WorkerReady):
                    self.ready[(msg.role, msg.index)] = True
                elif isinstance(msg, messages.WorkerStats):
                    self._on_stats(msg)

    def _check_processes(self, raise_on_death: bool = False) -> None:
        for spec, proc in zip(self.specs, self.processes, strict=False):
            code = proc.poll()
            key = (spec.role, spec.index)
            if code is not None and key not in self.dead and not self._stopping.is_set():
                self.dead[key] = code
                if raise_on_death:
                    raise WorkerStartError(f"{spec.role} worker {spec.index} exited with {code}:\n{self.log_tail()}")
                print(f"mm-serve: {spec.role} worker {spec.index} exited unexpectedly (code {code}); "
                      "in-flight requests fail, new ones get 503", file=sys.stderr, flush=True)
                self._fail_all(f"{spec.role} worker {spec.index} exited unexpectedly (code {code})")

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of every worker's log."""
        out = []
        for log in sorted(self.run_dir.glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(out)

    def request_stop(self) -> None:
        """Make a concurrent :meth:`start` give up and new submissions fail (cleanup is :meth:`shutdown`)."""
        self._stopping.set()

    @property
    def is_ready(self) -> bool:
        return bool(self.specs) and len(self.ready) == len(self.specs) and not self.dead and not self._stopping.is_set()

    def shutdown(self) -> None:
        """Stop every worker, unlink every ring segment, remove the run directory. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stopping.set()
        for sock in getattr(self, "_controls", {}).values():
            try:
                sock.send(messages.encode(messages.Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        stop_workers(self.processes)
        if self._receiver is not None:
            self._receiver.join(timeout=2.0)
        self._fail_all("the service is shutting down")
        for ring in self.rings:
            ring.close()
            ring.unlink()
        for sock in getattr(self, "_controls", {}).values():
            sock.close(linger=0)
        if hasattr(self, "_out"):
            self._out.close(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    # ---- requests --------------------------------------------------------------------------

    def submit(
        self, request_id: str, inputs: ProcessedInputs, params: SamplingParams, arrival_time: float | None = None
    ) -> RequestState:
        """Route a processed request to a prefill (or colocated) worker.

        Raises:
            InvalidRequestError: duplicate id, or prompt + ``max_tokens`` over the context length.
            RuntimeError: the service is stopped or a worker is down.
        """
        if self._stopping.is_set() or self.dead:
            raise RuntimeError("the service is not available (a worker is down or it is shutting down)")
        n = len(inputs.prompt_token_ids)
        limit = min(self.max_model_len, self.config.kv_cache.max_pages_per_gpu * self.config.kv_cache.page_size)
        if n + params.max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) is {n + params.max_tokens} "
                f"tokens, over this model's context length of {limit} tokens"
            )
        detok = IncrementalDetokenizer(self.inputs.tokenizer, params.stop)
        state = RequestState(request_id, n, detok)
        state.num_images = inputs.num_images
        if arrival_time is not None:
            state.arrival_time = arrival_time
        assert self.router is not None
        with self._lock:
            if request_id in self.requests:
                raise InvalidRequestError(f"duplicate request id {request_id!r}")
            prefill = self.router.pick_prefill()
            decode = self.router.pick_decode(pages_for(n + params.max_tokens, self.config.kv_cache.page_size))
            self.router.dispatched(request_id, prefill, decode, n, pages_for(n + 1, self.config.kv_cache.page_size))
            self.requests[request_id] = state
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        msg = messages.PrefillRequest(
            request_id=request_id, prompt_token_ids=inputs.prompt_token_ids,
            sampling=to_wire(params, self.eos_token_ids), generator_seed=seed, decode_index=decode,
            num_images=inputs.num_images,
            pixel_values=None if inputs.pixel_values is None else messages.TensorBlob.from_tensor(inputs.pixel_values),
            arrival_time=time.time(),
        )
        self._send(("colocated" if self.colocated else "prefill", prefill), msg)
        return state

    def abort(self, request_id: str) -> None:
        """Cancel a request wherever it is; its pages are freed by the workers."""
        with self._lock:
            state = self.requests.pop(request_id, None)
            assert self.router is not None
            prefill = self.router.prefill_of(request_id)
            decode = self.router.decode_of(request_id)
            self.router.finished(request_id)
        if state is None:
            return
        self._abort_workers(request_id, prefill, decode)
        state.fail("aborted")
        self._notify_finished(state)

    def _abort_workers(self, request_id: str, prefill: int | None, decode: int | None) -> None:
        """Tell the workers that may hold ``request_id`` to drop it (prefill queue, ring, decode)."""
        msg = messages.AbortRequest(request_id)
        if self.colocated:
            self._send(("colocated", decode or 0), msg)
            return
        if prefill is not None:
            self._send(("prefill", prefill), msg)
        if decode is not None:
            self._send(("decode", decode), msg)

    def _send(self, key: tuple[str, int], msg: msgspec.Struct) -> None:
        with self._send_lock:
            self._controls[key].send(messages.encode(msg))

    def query_stats(self, timeout_s: float = 2.0) -> dict[tuple[str, int], messages.WorkerStats]:
        """Ask every worker for fresh stats and wait for the answers (best effort)."""
        asked = time.monotonic()
        for key in self._controls:
            self._send(key, messages.StatsQuery())
        deadline = asked + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                fresh = [k for k in self._controls if k in self._stats_time and self._stats_time[k] >= asked]
            if len(fresh) == len(self._controls):
                break
            time.sleep(0.01)
        with self._lock:
            return dict(self.stats)

    # ---- receiver thread -------------------------------------------------------------------

    def _receive_loop(self) -> None:
        decoder = messages.decoder(messages.FromWorker)
        next_check = 0.0
        while not self._stopping.is_set():
            if self._out.poll(50):
                try:
                    msg = decoder.decode(self._out.recv())
                except msgspec.DecodeError:
                    continue
                try:
                    self._dispatch(msg)
                except Exception:  # a bug in one update must not stop every other request's delivery
                    traceback.print_exc()
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.5
                self._check_processes()

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, messages.TokenBatch):
            for update in msg.updates:
                self._on_update(msg.role, update)
        elif isinstance(msg, messages.WorkerStats):
            self._on_stats(msg)
        elif isinstance(msg, messages.RequestFailed):
            with self._lock:
                state = self.requests.pop(msg.request_id, None)
            if state is not None:
                state.fail(msg.message)

    def _on_update(self, role: str, update: messages.TokenUpdate) -> None:
        with self._lock:
            state = self.requests.get(update.request_id)
            if state is None:
                return
            assert self.router is not None
            if role == "prefill" or role == "colocated":
                self.router.prefilled(update.request_id)
            if role == "decode" or role == "colocated":
                self.router.claimed(update.request_id)
        if state.apply(update):
            with self._lock:
                self.requests.pop(update.request_id, None)
                prefill = self.router.prefill_of(update.request_id)
                decode = self.router.decode_of(update.request_id)
                self.router.finished(update.request_id)
            if update.finish_reason is None:  # finished here by a stop string: stop the workers
                self._abort_workers(update.request_id, prefill, decode)
            self._notify_finished(state)

    def _on_stats(self, msg: messages.WorkerStats) -> None:
        with self._lock:
            key = (msg.role, msg.index)
            self.stats[key] = msg
            self._stats_time[key] = time.monotonic()
            if self.router is not None and msg.role in ("decode", "colocated"):
                self.router.update_decode_stats(msg.index, msg.kv_pages_used, msg.kv_pages_total, msg.running)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            states = list(self.requests.values())
            self.requests.clear()
        for state in states:
            state.fail(message)
            self._notify_finished(state)

    def _notify_finished(self, state: RequestState) -> None:
        for listener in self.finish_listeners:
            listener(state)

    def health(self) -> dict[str, Any]:
        """Per-worker status: ``ready``, ``warming`` or ``down`` (with exit code)."""
        workers = {}
        for spec in self.specs:
            key = (spec.role, spec.index)
            if key in self.dead:
                status = f"down (exit {self.dead[key]})"
            else:
                status = "ready" if self.ready.get(key) else "warming"
            workers[f"{spec.role}{spec.index}"] = status
        return {"ok": bool(workers) and all(v == "ready" for v in workers.values()), "workers": workers}
