"""The front end's request client: submit, abort, receive token updates, worker stats, migrate.

It stands on a :class:`~mm_serve.cluster.worker_pool.WorkerPool` (the processes, rings
and sockets). :meth:`EngineClient.submit` routes a request (see :mod:`mm_serve.engine.router`)
to ready workers and returns its :class:`RequestState`; a receiver thread assembles the
workers' token updates into those states and runs the pool's supervision. When a worker
fails, every request that depended on it is migrated (:mod:`mm_serve.engine.flight`):

* prefill (or colocated) worker: the requests it had queued, was prefilling, or had
  prefilled but whose hand-off no decode worker has reported taking;
* decode worker: every request routed to it, whatever its stage;
* a hand-off a decode worker refused (:class:`~mm_serve.runtime.messages.HandoffFailed`).

A migrated request goes to a ready worker, or waits ("parked") while its role has one
restarting; past ``fault.max_migrations`` it fails with a message naming the fault.
:meth:`EngineClient.shutdown` fails what is still in flight and shuts the pool down.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mm_serve.cluster.worker_pool import WorkerFailure, WorkerKey, WorkerPool, WorkerStartError
from mm_serve.cluster.worker_specs import check_supported, engine_sizing
from mm_serve.config import ServiceConfig
from mm_serve.engine.detokenizer import IncrementalDetokenizer
from mm_serve.engine.flight import Flight
from mm_serve.engine.request_state import RequestState
from mm_serve.engine.router import LoadView, Router
from mm_serve.inputs.input_processor import InputProcessor, InvalidRequestError, ProcessedInputs
from mm_serve.models.model_config import load_model_config
from mm_serve.runtime import messages
from mm_serve.runtime.kv_cache import pages_for
from mm_serve.runtime.page_hashes import image_content_hashes, image_spans, page_hash_chain
from mm_serve.runtime.sampling_params import SamplingParams
from mm_serve.runtime.sampling_wire import to_wire
from mm_serve.runtime.worker_setup import prefix_key

if TYPE_CHECKING:
    from mm_serve.admission.predictor import Prediction

__all__ = ["EngineClient", "WorkerStartError"]

SUPERVISE_INTERVAL_S = 0.1  # how often the receiver thread runs the pool's supervision


class EngineClient:
    """Requests in flight on the workers of one service instance.

    Attributes:
        requests: request id -> :class:`RequestState` of every unfinished request.
        fault_counts: ``(kind, role)`` -> count, kinds ``request_migrations`` (requests moved
            after a fault of a worker of that role), ``handoff_failures`` (hand-offs refused
            by decode), ``requests_failed_by_fault`` (requests ended with an error by a fault).

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
        # the router lists queued looser requests for the promise rule only where it can act (no
        # per-view scan of the prefill queues otherwise): prediction and admission.protect_admitted on
        self._promises_kept = config.admission.predict and config.admission.protect_admitted
        sizing = engine_sizing(config, "cpu")
        self.context_limit = sizing.context_limit(self.model_config.text)
        self.prefix_key = prefix_key(str(self.model_dir), self.model_config, sizing)
        self.eos_token_ids = self.inputs.eos_token_ids
        self.stats: dict[WorkerKey, messages.WorkerStats] = {}
        self.requests: dict[str, RequestState] = {}
        self.fault_counts: Counter[tuple[str, str]] = Counter()
        self.finish_listeners: list[Callable[[RequestState], None]] = []  # called on the receiver thread
        self.step_listeners: list[Callable[[str, int, messages.StepTiming], None]] = []  # (role, index, timing), same thread
        self.router: Router | None = None
        self._flights: dict[str, Flight] = {}  # request id -> flight
        self._wire: dict[str, Flight] = {}  # wire id of the current attempt -> flight
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
            cache_aware=cfg.scheduler.prefill_routing == "cache_aware" and cfg.kv_cache.enable_prefix_caching,
            balance_tokens=cfg.scheduler.cache_aware_balance_tokens, prefill_pages=cfg.kv_cache.max_pages_per_gpu,
            page_size=cfg.kv_cache.page_size, encoder_images=self._encoder_cache_images(),
        )
        self._receiver = threading.Thread(target=self._receive_loop, name="mm-serve-receiver", daemon=True)
        self._receiver.start()

    def request_stop(self) -> None:
        """Make a concurrent :meth:`start` give up and new submissions fail (cleanup is :meth:`shutdown`)."""
        self.pool.request_stop()

    @property
    def is_ready(self) -> bool:
        """Whether a path serves now (one prefill and one decode worker, or the colocated one, ready)."""
        return self.pool.is_ready

    def _encoder_cache_images(self) -> int:
        """Images one prefill worker's encoder cache holds: its bytes over one image's embeddings
        (``[tokens_per_image, hidden]`` in the serving dtype); 0 without a cache or a vision tower."""
        sizing = engine_sizing(self.config, "cpu")
        per_image = self.prefix_key.tokens_per_image * self.model_config.text.hidden_size * sizing.torch_dtype.itemsize
        return sizing.encoder_cache_bytes // per_image if per_image and self.model_config.vision is not None else 0

    def load_view(self, rank: int, num_tokens: int, max_tokens: int,
                  inputs: ProcessedInputs | None = None) -> LoadView | None:
        """What a request of tier ``rank`` with ``num_tokens`` prompt tokens would find on the
        workers the router would pick now; None while a role has no ready worker. Given the
        request's ``inputs`` (its image hashes are filled in here, once), the view also says how
        much of its prompt the chosen prefill worker is believed to hold cached: tokens in its
        prefix cache, and images there or in its encoder cache (not encoded again)."""
        hashes: list[bytes] = []
        image_hashes: list[bytes] = []
        if inputs is not None:
            image_hashes = self.hash_images(inputs)
            hashes = self._page_hashes(inputs.prompt_token_ids, image_hashes)
        page_size = self.config.kv_cache.page_size
        with self._lock:
            prefills, decodes = self._ready_candidates()
            if self.router is None or not prefills or not decodes:
                return None
            view = self.router.view(rank, pages_for(num_tokens + max_tokens, page_size), prefills, decodes, hashes,
                                    tokens=num_tokens)
            num_images = 0 if inputs is None else inputs.num_images
            encode = self.router.images_to_encode(view.prefill, image_hashes) if image_hashes and len(
                image_hashes) == num_images else [True] * num_images
            view = dataclasses.replace(view, in_flight=len(self.requests), cached_images=encode.count(False))
        if not view.cached_pages or inputs is None:
            return view
        tokens = min(view.cached_pages * page_size, num_tokens - 1)  # the last token is always computed
        key = self.prefix_key
        spans = image_spans(inputs.prompt_token_ids, key.image_token_id, inputs.num_images, key.tokens_per_image)
        in_prefix = [i < len(spans) and spans[i][1] <= tokens for i in range(len(encode))]
        return dataclasses.replace(view, cached_tokens=tokens,
                                   cached_images=sum(1 for p, e in zip(in_prefix, encode, strict=True) if p or not e))

    def load_views(self, rank: int, num_tokens: int, max_tokens: int) -> list[LoadView]:
        """:meth:`load_view` as if each ready prefill worker were the one picked (no cache
        believed), for a bound that holds whichever the router picks later; empty while a role
        has no ready worker."""
        with self._lock:
            prefills, decodes = self._ready_candidates()
            if self.router is None or not prefills or not decodes:
                return []
            pages = pages_for(num_tokens + max_tokens, self.config.kv_cache.page_size)
            return [dataclasses.replace(self.router.view(rank, pages, [p], decodes), in_flight=len(self.requests))
                    for p in prefills]

    def _ready_candidates(self) -> tuple[list[int], list[int]]:
        """(prefill-side, decode-side) indices of the ready workers (the colocated worker is both)."""
        prefills = self.pool.ready_indices("colocated" if self.colocated else "prefill")
        return prefills, prefills if self.colocated else self.pool.ready_indices("decode")

    @staticmethod
    def hash_images(inputs: ProcessedInputs) -> list[bytes]:
        """The content hash of each of the request's images, computed once and kept on ``inputs``."""
        if not inputs.image_hashes and inputs.pixel_values is not None:
            inputs.image_hashes = image_content_hashes(inputs.pixel_values)
        return inputs.image_hashes

    def queued(self) -> tuple[int, int]:
        """(requests, prompt tokens) waiting for their first token: dispatched to a prefill
        worker and not yet prefilled, or parked while their worker restarts."""
        with self._lock:
            if self.router is None:
                return 0, 0
            requests, tokens = self.router.queued()
            parked = [f for f in self._flights.values() if f.parked]
            return requests + len(parked), tokens + sum(len(f.first.prompt_token_ids) for f in parked)

    def health(self) -> dict[str, Any]:
        """Service and per-worker status (:meth:`WorkerPool.health`)."""
        return self.pool.health()

    def log_tail(self, lines: int = 30) -> str:
        return self.pool.log_tail(lines)

    def fault_report(self) -> tuple[dict[tuple[str, str], int], dict[str, str]]:
        """Fault counters ``(kind, role) -> count`` (kinds ``worker_restarts``,
        ``request_migrations``, ``handoff_failures``, ``requests_failed_by_fault``) and each
        worker's status, for the metrics."""
        with self._lock:
            counts = dict(self.fault_counts)
        for role, n in self.pool.restart_counts.items():
            counts["worker_restarts", role] = n
        workers = self.pool.health()["workers"]
        assert isinstance(workers, dict)
        return counts, workers

    def shutdown(self) -> None:
        """Fail every request in flight, stop every worker, unlink every segment. Idempotent."""
        self.pool.request_stop()
        if self._receiver is not None:
            self._receiver.join(timeout=2.0)
        self.pool.shutdown()
        self._fail_all("the service is shutting down")

    # ---- requests --------------------------------------------------------------------------

    def submit(
        self, request_id: str, inputs: ProcessedInputs, params: SamplingParams, arrival_time: float | None = None,
        priority: int = 1, max_wait_s: float = 0.0, tier: str | None = None, prediction: Prediction | None = None,
    ) -> RequestState:
        """Route a processed request to a ready prefill (or colocated) worker; while its role
        has none ready but one restarting, the request waits for it.

        ``priority`` is its SLO tier rank (0 interactive, 1 standard, 2 batch) and
        ``max_wait_s`` the prefill wait (seconds) after which it is served as rank 0 (0: never);
        ``tier`` (its name) and the admission's ``prediction`` are kept on the state for the metrics
        and the predictor's feedback.

        Raises:
            InvalidRequestError: duplicate id, or prompt + ``max_tokens`` over the context length.
            RuntimeError: the service is stopped, or no worker of a role it needs is left.
        """
        if self.pool.stopping.is_set() or self.router is None:
            raise RuntimeError("the service is not available (it is shutting down)")
        self._check_recoverable()
        n = len(inputs.prompt_token_ids)
        self.inputs.check_context(n, params.max_tokens, self.context_limit)
        state = RequestState(request_id, n, IncrementalDetokenizer(self.inputs.tokenizer, params.stop))
        state.num_images = inputs.num_images
        state.tier, state.prediction = tier, prediction
        state.predicted_ttft_s = None if prediction is None else prediction.ttft_s
        if arrival_time is not None:
            state.arrival_time = arrival_time
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        image_hashes = self.hash_images(inputs)
        first = messages.PrefillRequest(
            request_id=request_id, prompt_token_ids=inputs.prompt_token_ids,
            sampling=to_wire(params, self.eos_token_ids), generator_seed=seed, decode_index=0,
            num_images=inputs.num_images,
            pixel_values=None if inputs.pixel_values is None else messages.TensorBlob.from_tensor(inputs.pixel_values),
            arrival_time=time.time(), priority=priority, max_wait_s=max_wait_s, image_hashes=image_hashes,
        )
        flight = Flight(state, first, page_hashes=self._page_hashes(inputs.prompt_token_ids, image_hashes))
        with self._lock:
            if request_id in self.requests:
                raise InvalidRequestError(f"duplicate request id {request_id!r}")
            self.requests[request_id] = state
            self._flights[request_id] = flight
            self._dispatch(flight)
        return state

    def _page_hashes(self, token_ids: list[int], image_hashes: list[bytes]) -> list[bytes]:
        """The prompt's full-page hashes as its prefill worker computes them (for cache-aware
        routing; [] when routing is not cache-aware)."""
        if self.router is None or not self.router.cache_aware:
            return []
        key = self.prefix_key
        spans = image_spans(token_ids, key.image_token_id, len(image_hashes), key.tokens_per_image)
        return page_hash_chain(token_ids, self.config.kv_cache.page_size, key.salt, image_hashes[: len(spans)], spans)

    def _check_recoverable(self) -> None:
        roles = [("colocated",)] if self.colocated else [("prefill",), ("decode",)]
        for role in roles:
            if not self.pool.may_recover(*role):
                raise RuntimeError(f"the service is not available: every {role[0]} worker is down "
                                   "(past fault.max_restarts); see /health")

    def _dispatch(self, flight: Flight) -> None:
        """Send the flight's current attempt to ready workers, or park it. Call under the lock."""
        assert self.router is not None
        prefills, decodes = self._ready_candidates()
        if not prefills or not decodes:
            flight.parked = True
            flight.state.delayed_by_fault = True
            return
        page_size = self.config.kv_cache.page_size
        n = len(flight.first.prompt_token_ids) + flight.base
        prefill = self.router.pick_prefill(prefills, flight.page_hashes, n)
        decode = prefill if self.colocated else self.router.pick_decode(
            pages_for(n + flight.remaining_tokens(), page_size), decodes)
        flight.parked = False
        flight.prefill, flight.decode = prefill, decode
        self._wire[flight.wire_id] = flight
        self.router.dispatched(flight.wire_id, prefill, decode, n, pages_for(n + 1, page_size),
                               flight.first.priority, flight.first.num_images, flight.page_hashes,
                               0.0 if self.colocated else flight.first.max_wait_s,  # colocated: no ageing
                               arrived_at=flight.state.arrival_time if self._promises_kept else None,
                               image_hashes=flight.first.image_hashes)
        # not delivered when the worker died a moment ago: supervision finds it and migrates this flight
        self.pool.send(("colocated" if self.colocated else "prefill", prefill), flight.message(decode, time.time()))

    def abort(self, request_id: str) -> None:
        """Cancel a request wherever it is; its pages are freed by the workers."""
        with self._lock:
            state = self.requests.pop(request_id, None)
            flight = self._flights.pop(request_id, None)
            if flight is not None:
                self._drop_attempt(flight)
        if state is None:
            return
        state.fail("aborted")
        self._notify_finished(state)

    def _drop_attempt(self, flight: Flight) -> None:
        """Forget the flight's current attempt: the router forgets it, the workers that may hold
        it drop it (prefill queue, ring, decode). Call under the lock."""
        assert self.router is not None
        wire_id = flight.wire_id
        self._wire.pop(wire_id, None)
        self.router.finished(wire_id)
        if flight.parked or flight.prefill is None:
            return
        msg = messages.AbortRequest(wire_id)
        if self.colocated:
            self.pool.send(("colocated", flight.prefill), msg)
            return
        self.pool.send(("prefill", flight.prefill), msg)
        if flight.decode is not None:
            self.pool.send(("decode", flight.decode), msg)

    def query_stats(self, timeout_s: float = 2.0) -> dict[WorkerKey, messages.WorkerStats]:
        """Ask every ready worker for fresh stats and wait for the answers (best effort)."""
        asked = time.monotonic()
        keys = [k for k in self.pool.keys if self.pool.send(k, messages.StatsQuery())]
        deadline = asked + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                fresh = [k for k in keys if self._stats_time.get(k, -1.0) >= asked]
            if len(fresh) == len(keys):
                break
            time.sleep(0.01)
        with self._lock:
            return dict(self.stats)

    # ---- faults ----------------------------------------------------------------------------

    def _on_failure(self, failure: WorkerFailure) -> None:
        """Move every request that depended on the failed worker (see the module docstring)."""
        role, index = failure.key
        with self._lock:
            self.stats.pop(failure.key, None)
            self._stats_time.pop(failure.key, None)
            if self.router is not None and role in ("decode", "colocated"):
                self.router.reset_decode(index)
            if self.router is not None and role in ("prefill", "colocated"):
                self.router.reset_prefill(index)
            if role == "decode":
                hit = [f for f in self._flights.values() if not f.parked and f.decode == index]
            else:
                hit = [f for f in self._flights.values()
                       if not f.parked and f.prefill == index and (role == "colocated" or not f.claimed)]
            for flight in hit:
                self._migrate(flight, f"{role} worker {index} {failure.reason}", role)
            if failure.down:
                self._fail_unrecoverable(role)

    def _migrate(self, flight: Flight, reason: str, role: str) -> None:
        """Resubmit the flight's request from what it has received, or fail it past
        ``fault.max_migrations``. Call under the lock."""
        self._drop_attempt(flight)
        limit = self.config.fault.max_migrations
        if flight.migrations >= limit:
            self.fault_counts["requests_failed_by_fault", role] += 1
            self._finish_failed(flight, f"{reason}; the request was moved {flight.migrations} time(s) already "
                                        f"(fault.max_migrations = {limit})")
            return
        self.fault_counts["request_migrations", role] += 1
        flight.state.delayed_by_fault = True
        flight.next_attempt()
        if flight.remaining_tokens() <= 0:  # every token arrived; only the finish was lost
            self._finish_failed(flight, reason)
            return
        self._dispatch(flight)

    def _finish_failed(self, flight: Flight, message: str) -> None:
        """End a flight with an error. Call under the lock."""
        self.requests.pop(flight.request_id, None)
        self._flights.pop(flight.request_id, None)
        flight.state.fail(message)
        self._notify_finished(flight.state)

    def _fail_unrecoverable(self, role: str) -> None:
        """After a worker of ``role`` went down for good: when no worker of a role the
        requests need is left, fail every request. Call under the lock."""
        try:
            self._check_recoverable()
        except RuntimeError as exc:
            for flight in list(self._flights.values()):
                self._drop_attempt(flight)
                self.fault_counts["requests_failed_by_fault", role] += 1
                self._finish_failed(flight, str(exc))

    def _dispatch_parked(self) -> None:
        with self._lock:
            for flight in [f for f in self._flights.values() if f.parked]:
                self._dispatch(flight)

    # ---- receiver thread -------------------------------------------------------------------

    def _receive_loop(self) -> None:
        next_check = 0.0
        while not self.pool.stopping.is_set():
            msg = self.pool.recv(50)
            if msg is not None:
                try:
                    self._handle(msg)
                except Exception:  # a bug in one update must not stop every other request's delivery
                    traceback.print_exc()
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + SUPERVISE_INTERVAL_S
                try:
                    for failure in self.pool.supervise():
                        self._on_failure(failure)
                except Exception:
                    traceback.print_exc()

    def _handle(self, msg: object) -> None:
        if not self.pool.observe(msg):
            return
        if isinstance(msg, messages.TokenBatch):
            for update in msg.updates:
                self._on_update(msg.role, update)
            if msg.step is not None:
                for listener in self.step_listeners:
                    listener(msg.role, msg.index, msg.step)
        elif isinstance(msg, messages.PrefillStarted):
            with self._lock:
                if self.router is not None:
                    self.router.batch_started(msg.index, msg.request_ids)
        elif isinstance(msg, messages.WorkerStats):
            self._on_stats(msg)
        elif isinstance(msg, messages.WorkerReady):
            self._dispatch_parked()
        elif isinstance(msg, messages.HandoffFailed):
            with self._lock:
                flight = self._wire.get(msg.request_id)
                if flight is not None:
                    self.fault_counts["handoff_failures", "decode"] += 1
                    self._migrate(flight, f"its hand-off was refused ({msg.reason})", "decode")
        elif isinstance(msg, messages.RequestFailed):
            with self._lock:
                flight = self._wire.get(msg.request_id)
                if flight is not None:
                    self._drop_attempt(flight)
                    self._finish_failed(flight, msg.message)

    def _on_update(self, role: str, update: messages.TokenUpdate) -> None:
        with self._lock:
            flight = self._wire.get(update.request_id)
            if flight is None:
                return  # finished, aborted, or an attempt replaced after a fault
            assert self.router is not None
            if role in ("prefill", "colocated"):
                self.router.prefilled(update.request_id)
            if role in ("decode", "colocated"):
                self.router.claimed(update.request_id)
                flight.claimed = True
            update.start_index += flight.base
        state = flight.state
        if state.apply(update):
            with self._lock:
                if self._flights.get(flight.request_id) is flight:
                    del self._flights[flight.request_id]
                    self.requests.pop(flight.request_id, None)
                if update.finish_reason is None:  # finished here by a stop string: stop the workers
                    self._drop_attempt(flight)
                else:
                    self._wire.pop(flight.wire_id, None)
                    assert self.router is not None
                    self.router.finished(flight.wire_id)
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
            self._flights.clear()
            self._wire.clear()
        for state in states:
            state.fail(message)
            self._notify_finished(state)

    def _notify_finished(self, state: RequestState) -> None:
        for listener in self.finish_listeners:
            listener(state)
