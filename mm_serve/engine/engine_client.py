"""The front end's request client: submit, abort, receive token updates, worker stats.

It stands on a :class:`~mm_serve.engine.worker_pool.WorkerPool` (the processes, rings
and sockets). :meth:`EngineClient.submit` routes a request (see :mod:`mm_serve.router`)
and returns its :class:`RequestState`; a receiver thread assembles the workers' token
updates into those states; :meth:`EngineClient.shutdown` fails what is still in flight
and shuts the pool down.
"""

from __future__ import annotations

import random
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mm_serve.config import ServiceConfig
from mm_serve.engine.detokenizer import IncrementalDetokenizer
from mm_serve.engine.input_processor import InputProcessor, InvalidRequestError, ProcessedInputs
from mm_serve.engine.request_state import RequestState
from mm_serve.engine.worker_pool import WorkerKey, WorkerPool, WorkerStartError
from mm_serve.engine.worker_specs import check_supported, engine_sizing
from mm_serve.models.model_config import load_model_config
from mm_serve.router import Router
from mm_serve.runtime import messages
from mm_serve.runtime.kv_cache import pages_for
from mm_serve.runtime.sampling_params import SamplingParams
from mm_serve.runtime.sampling_wire import to_wire

__all__ = ["EngineClient", "WorkerStartError"]


class EngineClient:
    """Requests in flight on the workers of one service instance.

    Raises (constructor):
        ConfigError: the config asks for what the runtime cannot run.
        CheckpointError: the model cannot be read.
    """

    def __init__(self, model_dir: str | Path, config: ServiceConfig, inputs: InputProcessor | None = None) -> None:
        check_supported(config)
        self.model_dir = Path(model_dir)
        self.config = config
        self.model_config = load_model_config(self.model_dir)
        self.inputs = inputs or InputProcessor(self.model_dir, self.model_config)
        self.pool = WorkerPool(self.model_dir, config, self.model_config)
        self.colocated = self.pool.colocated
        self.context_limit = engine_sizing(config, "cpu").context_limit(self.model_config.text)
        self.eos_token_ids = self.inputs.eos_token_ids
        self.stats: dict[WorkerKey, messages.WorkerStats] = {}
        self.requests: dict[str, RequestState] = {}
        self.finish_listeners: list[Callable[[RequestState], None]] = []  # called on the receiver thread
        self.router: Router | None = None
        self._lock = threading.RLock()
        self._seed_rng = random.Random(config.seed)
        self._receiver: threading.Thread | None = None
        self._stats_time: dict[WorkerKey, float] = {}

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self, timeout_s: float = 600.0) -> None:
        """Start the workers and wait for all of them to be ready.

        Raises:
            WorkerStartError: a worker died or timed out during start-up (everything is cleaned up).
        """
        try:
            self.pool.start(timeout_s, self._on_stats)
        except BaseException:
            self.shutdown()
            raise
        cfg = self.config
        self.router = Router(
            self.pool.num_workers("prefill", "colocated"), self.pool.num_workers("decode", "colocated"),
            cfg.kv_cache.max_pages_per_gpu, cfg.scheduler.decode_max_concurrent,
        )
        self._receiver = threading.Thread(target=self._receive_loop, name="mm-serve-receiver", daemon=True)
        self._receiver.start()

    def request_stop(self) -> None:
        """Make a concurrent :meth:`start` give up and new submissions fail (cleanup is :meth:`shutdown`)."""
        self.pool.request_stop()

    @property
    def is_ready(self) -> bool:
        return self.pool.is_ready

    def health(self) -> dict[str, Any]:
        """Per-worker status (:meth:`WorkerPool.health`)."""
        return self.pool.health()

    def log_tail(self, lines: int = 30) -> str:
        return self.pool.log_tail(lines)

    def shutdown(self) -> None:
        """Fail every request in flight, stop every worker, unlink every segment. Idempotent."""
        self.pool.request_stop()
        if self._receiver is not None:
            self._receiver.join(timeout=2.0)
        self.pool.shutdown()
        self._fail_all("the service is shutting down")

    # ---- requests --------------------------------------------------------------------------

    def submit(
        self, request_id: str, inputs: ProcessedInputs, params: SamplingParams, arrival_time: float | None = None
    ) -> RequestState:
        """Route a processed request to a prefill (or colocated) worker.

        Raises:
            InvalidRequestError: duplicate id, or prompt + ``max_tokens`` over the context length.
            RuntimeError: the service is stopped or a worker is down.
        """
        if self.pool.stopping.is_set() or self.pool.dead or self.router is None:
            raise RuntimeError("the service is not available (a worker is down or it is shutting down)")
        n = len(inputs.prompt_token_ids)
        self.inputs.check_context(n, params.max_tokens, self.context_limit)
        state = RequestState(request_id, n, IncrementalDetokenizer(self.inputs.tokenizer, params.stop))
        state.num_images = inputs.num_images
        if arrival_time is not None:
            state.arrival_time = arrival_time
        page_size = self.config.kv_cache.page_size
        with self._lock:
            if request_id in self.requests:
                raise InvalidRequestError(f"duplicate request id {request_id!r}")
            prefill = self.router.pick_prefill()
            decode = self.router.pick_decode(pages_for(n + params.max_tokens, page_size))
            self.router.dispatched(request_id, prefill, decode, n, pages_for(n + 1, page_size))
            self.requests[request_id] = state
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        msg = messages.PrefillRequest(
            request_id=request_id, prompt_token_ids=inputs.prompt_token_ids,
            sampling=to_wire(params, self.eos_token_ids), generator_seed=seed, decode_index=decode,
            num_images=inputs.num_images,
            pixel_values=None if inputs.pixel_values is None else messages.TensorBlob.from_tensor(inputs.pixel_values),
            arrival_time=time.time(),
        )
        self.pool.send(("colocated" if self.colocated else "prefill", prefill), msg)
        return state

    def abort(self, request_id: str) -> None:
        """Cancel a request wherever it is; its pages are freed by the workers."""
        with self._lock:
            state = self.requests.pop(request_id, None)
            prefill, decode = self._forget_route(request_id)
        if state is None:
            return
        self._abort_workers(request_id, prefill, decode)
        state.fail("aborted")
        self._notify_finished(state)

    def _forget_route(self, request_id: str) -> tuple[int | None, int | None]:
        """The workers ``request_id`` was routed to; the router forgets it. Call under the lock."""
        assert self.router is not None
        route = self.router.prefill_of(request_id), self.router.decode_of(request_id)
        self.router.finished(request_id)
        return route

    def _abort_workers(self, request_id: str, prefill: int | None, decode: int | None) -> None:
        """Tell the workers that may hold ``request_id`` to drop it (prefill queue, ring, decode)."""
        msg = messages.AbortRequest(request_id)
        if self.colocated:
            self.pool.send(("colocated", decode or 0), msg)
            return
        if prefill is not None:
            self.pool.send(("prefill", prefill), msg)
        if decode is not None:
            self.pool.send(("decode", decode), msg)

    def query_stats(self, timeout_s: float = 2.0) -> dict[WorkerKey, messages.WorkerStats]:
        """Ask every worker for fresh stats and wait for the answers (best effort)."""
        asked = time.monotonic()
        keys = self.pool.keys
        for key in keys:
            self.pool.send(key, messages.StatsQuery())
        deadline = asked + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                fresh = [k for k in keys if self._stats_time.get(k, -1.0) >= asked]
            if len(fresh) == len(keys):
                break
            time.sleep(0.01)
        with self._lock:
            return dict(self.stats)

    # ---- receiver thread -------------------------------------------------------------------

    def _receive_loop(self) -> None:
        next_check = 0.0
        while not self.pool.stopping.is_set():
            msg = self.pool.recv(50)
            if msg is not None:
                try:
                    self._dispatch(msg)
                except Exception:  # a bug in one update must not stop every other request's delivery
                    traceback.print_exc()
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.5
                self._check_workers()

    def _check_workers(self) -> None:
        for role, index, code in self.pool.reap():
            print(f"mm-serve: {role} worker {index} exited unexpectedly (code {code}); "
                  "in-flight requests fail, new ones get 503", file=sys.stderr, flush=True)
            self._fail_all(f"{role} worker {index} exited unexpectedly (code {code})")

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
            if role in ("prefill", "colocated"):
                self.router.prefilled(update.request_id)
            if role in ("decode", "colocated"):
                self.router.claimed(update.request_id)
        if state.apply(update):
            with self._lock:
                self.requests.pop(update.request_id, None)
                prefill, decode = self._forget_route(update.request_id)
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
