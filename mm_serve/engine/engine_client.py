"""The front end's request client: submit, abort, views of the load for admission, stats.

It stands on a :class:`~mm_serve.cluster.worker_pool.WorkerPool` (the processes, rings and
sockets). :meth:`EngineClient.submit` turns a processed request into a
:class:`~mm_serve.engine.flight.Flight` and hands it to the
:class:`~mm_serve.engine.flight_table.FlightTable`, which routes it to ready workers (and
migrates it when one fails); a :class:`~mm_serve.engine.receiver.Receiver` thread assembles the
workers' token updates into each request's :class:`RequestState` and runs the pool's
supervision. :meth:`EngineClient.shutdown` fails what is still in flight and shuts the pool down.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mm_serve.cluster.worker_pool import WorkerKey, WorkerPool, WorkerStartError
from mm_serve.cluster.worker_specs import check_supported, engine_sizing
from mm_serve.config import ServiceConfig
from mm_serve.engine.flight import Flight
from mm_serve.engine.flight_table import FlightTable
from mm_serve.engine.load_ledger import LoadLedger
from mm_serve.engine.load_view import LoadView
from mm_serve.engine.receiver import Receiver
from mm_serve.engine.request_state import RequestState
from mm_serve.engine.router import Router
from mm_serve.ground.roles import Role
from mm_serve.ground.tiers import Tier
from mm_serve.inputs.input_processor import InputProcessor, InvalidRequestError, ProcessedInputs
from mm_serve.models.registry import load_model_config
from mm_serve.runtime import messages
from mm_serve.runtime.detokenizer import IncrementalDetokenizer
from mm_serve.runtime.page_hashes import image_content_hashes, image_spans, page_hash_chain, salted
from mm_serve.runtime.sampling_params import SamplingParams
from mm_serve.runtime.sampling_wire import to_wire
from mm_serve.runtime.worker_setup import prefix_key

__all__ = ["EngineClient", "WorkerStartError"]


class EngineClient:
    """Requests in flight on the workers of one service instance.

    Attributes:
        requests: request id -> :class:`RequestState` of every unfinished request.
        finish_listeners: called with each request's state when it finishes, on the receiver thread.
        step_listeners: called with (role, index, timing) for every timed worker step, same thread.

    Raises (constructor):
        ConfigError: the config asks for what the runtime cannot run.
        CheckpointError: the model cannot be read (with ``defer_inputs``, its tokenizer or media processor
            at the first use of :attr:`inputs` instead).
    """

    def __init__(self, model_dir: str | Path, config: ServiceConfig, inputs: InputProcessor | None = None,
                 defer_inputs: bool = False) -> None:
        """``inputs``: a tokenizer and media processors loaded elsewhere; otherwise they load here, or with
        ``defer_inputs`` at the first use of :attr:`inputs`, so a caller can start the workers first and the
        two overlap (about 2 s of a server's start)."""
        check_supported(config)
        self.model_dir = Path(model_dir)
        self.model_config = load_model_config(self.model_dir)
        # dtype auto is settled here, once, before any worker, ring or cache is sized (one type for every pair)
        config = config.model_copy(update={"dtype": config.serving_dtype(self.model_config.raw)})
        self.config = config
        self._inputs = inputs
        self._inputs_lock = threading.Lock()
        if not defer_inputs:
            _ = self.inputs
        self.pool = WorkerPool(self.model_dir, config, self.model_config)
        self.colocated = self.pool.colocated
        sizing = engine_sizing(config, "cpu")
        self.context_limit = sizing.context_limit(self.model_config.text)
        self.prefix_key = prefix_key(str(self.model_dir), self.model_config, sizing)
        self.finish_listeners: list[Callable[[RequestState], None]] = []
        self.flights = FlightTable(self.pool, config, self._notify_finished)
        self.requests = self.flights.requests
        self.receiver = Receiver(self.pool, self.flights)
        self.stats = self.receiver.stats
        self.step_listeners = self.receiver.step_listeners
        self._seed_rng = random.Random(config.seed)

    @property
    def inputs(self) -> InputProcessor:
        """The tokenizer and media processors (loaded at the first use with ``defer_inputs``).

        Raises:
            CheckpointError: they cannot be loaded from the checkpoint.
        """
        if self._inputs is None:
            with self._inputs_lock:
                if self._inputs is None:
                    self._inputs = InputProcessor(self.model_dir, self.model_config)
        return self._inputs

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """End-of-sequence token ids (:attr:`InputProcessor.eos_token_ids`)."""
        return self.inputs.eos_token_ids

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self, timeout_s: float = 600.0) -> None:
        """Start the workers and wait for all of them to be ready.

        Raises:
            WorkerStartError: a worker died or timed out during start-up (everything is cleaned up).
        """
        try:
            self.pool.start(timeout_s, self.receiver.on_stats)
        except BaseException:
            self.shutdown()
            raise
        cfg = self.config
        prefill_role = self.flights.prefill_role
        decode_role = Role.COLOCATED if self.colocated else Role.DECODE
        ledger = LoadLedger(self.pool.num_workers(prefill_role), self.pool.num_workers(decode_role),
                            cfg.kv_cache.max_pages_per_gpu)
        router = Router(
            ledger, cfg.scheduler.decode_max_concurrent,
            cache_aware=cfg.scheduler.prefill_routing == "cache_aware" and cfg.kv_cache.enable_prefix_caching,
            balance_tokens=cfg.scheduler.cache_aware_balance_tokens, prefill_pages=cfg.kv_cache.max_pages_per_gpu,
            page_size=cfg.kv_cache.page_size, encoder_images=self._encoder_cache_images(),
        )
        with self.flights.lock:
            self.flights.ledger, self.flights.router = ledger, router
        self.receiver.start()

    @property
    def router(self) -> Router | None:
        """The router (None until the workers are ready)."""
        return self.flights.router

    @property
    def ledger(self) -> LoadLedger | None:
        """The load ledger (None until the workers are ready)."""
        return self.flights.ledger

    def request_stop(self) -> None:
        """Make a concurrent :meth:`start` give up and new submissions fail (cleanup is :meth:`shutdown`)."""
        self.pool.request_stop()

    @property
    def is_ready(self) -> bool:
        """Whether a path serves now (one prefill and one decode worker, or the colocated one, ready)."""
        return self.pool.is_ready

    def shutdown(self) -> None:
        """Fail every request in flight, stop every worker, unlink every segment. Idempotent."""
        self.pool.request_stop()
        self.receiver.join(2.0)
        self.pool.shutdown()
        self.flights.fail_all("the service is shutting down")

    def _encoder_cache_images(self) -> int:
        """Images one prefill worker's encoder cache holds: its bytes over one image's embeddings
        (``[image tokens, hidden]`` in the serving dtype); 0 without a cache or a vision tower."""
        vision = self.model_config.vision
        if vision is None:
            return 0
        sizing = engine_sizing(self.config, "cpu")
        per_image = vision.max_image_tokens * self.model_config.text.hidden_size * sizing.torch_dtype.itemsize
        return sizing.encoder_cache_bytes // per_image if per_image else 0

    # ---- the load, as admission sees it ----------------------------------------------------

    def load_view(self, tier: Tier, num_tokens: int, max_tokens: int,
                  inputs: ProcessedInputs | None = None) -> LoadView | None:
        """What a request of ``tier`` with ``num_tokens`` prompt tokens would find on the workers
        the router would pick now; None while a role has no ready worker. Given the request's
        ``inputs`` (its image hashes are filled in here, once), the view also says how much of its
        prompt the chosen prefill worker is believed to hold cached: tokens in its prefix cache,
        and images there or in its encoder cache (not encoded again)."""
        hashes: list[bytes] = []
        image_hashes: list[bytes] = []
        if inputs is not None:
            image_hashes = self.hash_images(inputs)
            hashes = self._page_hashes(inputs.prompt_token_ids, image_hashes, inputs.image_token_counts,
                                       inputs.cache_salt)
        flights = self.flights
        with flights.lock:
            prefills, decodes = flights.ready_candidates()
            if flights.router is None or flights.ledger is None or not prefills or not decodes:
                return None
            route = flights.router.route(flights.decode_pages(num_tokens, max_tokens), prefills, decodes, hashes,
                                         tokens=num_tokens)
            view = flights.ledger.view(tier, route)
            num_images = 0 if inputs is None else inputs.num_images
            encode = flights.router.images_to_encode(view.prefill, image_hashes) if image_hashes and len(
                image_hashes) == num_images else [True] * num_images
            tiles = [1] * num_images if inputs is None else inputs.tiles_per_image
            view = dataclasses.replace(view, in_flight=len(self.requests),
                                       cached_images=sum(n for n, e in zip(tiles, encode, strict=True) if not e))
        if not view.cached_pages or inputs is None:
            return view
        tokens = min(view.cached_pages * self.config.kv_cache.page_size, num_tokens - 1)  # the last is computed
        key = self.prefix_key
        spans = image_spans(inputs.prompt_token_ids, key.image_token_id, inputs.image_token_counts)
        in_prefix = [i < len(spans) and spans[i][1] <= tokens for i in range(len(encode))]
        return dataclasses.replace(view, cached_tokens=tokens, cached_images=sum(
            n for n, p, e in zip(inputs.tiles_per_image, in_prefix, encode, strict=True) if p or not e))

    def load_views(self, tier: Tier, num_tokens: int, max_tokens: int) -> list[LoadView]:
        """:meth:`load_view` as if each ready prefill worker were the one picked (no cache
        believed), for a bound that holds whichever the router picks later; empty while a role
        has no ready worker."""
        flights = self.flights
        with flights.lock:
            prefills, decodes = flights.ready_candidates()
            if flights.router is None or flights.ledger is None or not prefills or not decodes:
                return []
            pages = flights.decode_pages(num_tokens, max_tokens)
            return [dataclasses.replace(flights.ledger.view(tier, flights.router.route(pages, [p], decodes)),
                                        in_flight=len(self.requests)) for p in prefills]

    def queued(self) -> tuple[int, int]:
        """(requests, prompt tokens) waiting for their first token: dispatched to a prefill
        worker and not yet prefilled, or parked while their worker restarts."""
        with self.flights.lock:
            if self.flights.ledger is None:
                return 0, 0
            requests, tokens = self.flights.ledger.queued()
            parked = self.flights.parked()
            return requests + len(parked), tokens + sum(len(f.first.prompt_token_ids) for f in parked)

    @staticmethod
    def hash_images(inputs: ProcessedInputs) -> list[bytes]:
        """The content hash of each of the request's images (:func:`salted` with its ``cache_salt``: the
        encoder cache's key), computed once and kept on ``inputs``."""
        if not inputs.image_hashes and inputs.pixel_values is not None:
            inputs.image_hashes = [salted(h, inputs.cache_salt) for h in image_content_hashes(
                inputs.pixel_values, inputs.image_tiles, inputs.image_sizes, inputs.image_second_per_grid)]
        return inputs.image_hashes

    def _page_hashes(self, token_ids: list[int], image_hashes: list[bytes], token_counts: list[int],
                     request_salt: bytes = b"") -> list[bytes]:
        """The prompt's full-page hashes as its prefill worker computes them (for cache-aware
        routing; [] when routing is not cache-aware), from the root :func:`salted` with ``request_salt``."""
        router = self.flights.router
        if router is None or not router.cache_aware:
            return []
        key = self.prefix_key
        spans = image_spans(token_ids, key.image_token_id, token_counts[: len(image_hashes)])
        return page_hash_chain(token_ids, self.config.kv_cache.page_size, salted(key.salt, request_salt),
                               image_hashes[: len(spans)], spans)

    # ---- requests --------------------------------------------------------------------------

    def submit(self, request_id: str, inputs: ProcessedInputs, params: SamplingParams,
               arrival_time: float | None = None, tier: Tier | None = None, max_wait_s: float = 0.0,
               predicted_ttft_s: float | None = None, counts_inputs: bool = True) -> RequestState:
        """Route a processed request to a ready prefill (or colocated) worker; while its role
        has none ready but one restarting, the request waits for it.

        ``tier`` is its SLO tier (None: standard, not counted per tier in the metrics) and
        ``max_wait_s`` the prefill wait (seconds) after which it is served as the tightest tier
        (0: never); ``arrival_time`` (``time.monotonic()`` seconds) when its call arrived;
        ``predicted_ttft_s`` the admission's prediction, kept on the state for the metrics;
        ``counts_inputs`` False for a call's second and later choices, whose prompt tokens and images the
        metrics counted with its first.

        Raises:
            InvalidRequestError: duplicate id, or prompt + ``max_tokens`` over the context length.
            RuntimeError: the service is stopped, or no worker of a role it needs is left.
        """
        if self.pool.stopping.is_set() or self.flights.router is None:
            raise RuntimeError("the service is not available (it is shutting down)")
        self.flights.check_recoverable()
        n = len(inputs.prompt_token_ids)
        self.inputs.check_context(n, params.max_tokens, self.context_limit)
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        state = RequestState(request_id, n, IncrementalDetokenizer(self.inputs.tokenizer, params.stop,
                                                                             min_tokens=params.min_tokens))
        state.num_images = inputs.num_images
        state.counts_inputs = counts_inputs
        state.structured = params.structured is not None
        state.tier, state.predicted_ttft_s = tier, predicted_ttft_s
        if arrival_time is not None:
            state.arrival_time = arrival_time
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        image_hashes = self.hash_images(inputs)
        first = messages.PrefillRequest(
            request_id=request_id, prompt_token_ids=inputs.prompt_token_ids,
            sampling=to_wire(params, self.eos_token_ids), generator_seed=seed, decode_index=0,
            num_images=inputs.num_images,
            pixel_values=None if inputs.pixel_values is None else messages.TensorBlob.from_tensor(inputs.pixel_values),
            arrival_time=time.time(), priority=int(Tier.STANDARD if tier is None else tier), max_wait_s=max_wait_s,
            image_hashes=image_hashes, image_token_counts=list(inputs.image_token_counts),
            image_tiles=list(inputs.image_tiles), image_sizes=list(inputs.image_sizes),
            image_second_per_grid=list(inputs.image_second_per_grid), cache_salt=inputs.cache_salt,
        )
        flight = Flight(state, first, page_hashes=self._page_hashes(inputs.prompt_token_ids, image_hashes,
                                                                    inputs.image_token_counts, inputs.cache_salt))
        try:
            self.flights.add(flight)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        return state

    def abort(self, request_id: str, failure: str | None = None) -> None:
        """Cancel a request wherever it is; its pages are freed by the workers. It ends cancelled by its
        caller, or with ``failure`` when given (the service gave up on it: its deadline passed)."""
        state = self.flights.abort(request_id)
        if state is not None:
            if failure is None:
                state.abort()
            else:
                state.fail(failure)
            self._notify_finished(state)

    # ---- workers ---------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """Service and per-worker status (:meth:`WorkerPool.health`)."""
        return self.pool.health()

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the workers' logs."""
        return self.pool.log_tail(lines)

    @property
    def fault_counts(self) -> dict[tuple[str, str], int]:
        """``(kind, role)`` -> count of the request-side fault counters (:class:`FlightTable`)."""
        return self.flights.fault_counts

    def fault_report(self) -> tuple[dict[tuple[str, str], int], dict[str, str]]:
        """Fault counters ``(kind, role) -> count`` (kinds ``worker_restarts``,
        ``request_migrations``, ``handoff_failures``, ``requests_failed_by_fault``) and each
        worker's status, for the metrics."""
        with self.flights.lock:
            counts = dict(self.flights.fault_counts)
        for role, n in self.pool.restart_counts.items():
            counts["worker_restarts", role] = n
        workers = self.pool.health()["workers"]
        assert isinstance(workers, dict)
        return counts, workers

    def query_stats(self, timeout_s: float = 2.0) -> dict[WorkerKey, messages.WorkerStats]:
        """Ask every ready worker for fresh stats and wait for the answers (best effort)."""
        asked = time.monotonic()
        keys = [k for k in self.pool.keys if self.pool.send(k, messages.StatsQuery())]
        deadline = asked + timeout_s
        while time.monotonic() < deadline:
            with self.flights.lock:
                fresh = [k for k in keys if self.receiver.stats_time.get(k, -1.0) >= asked]
            if len(fresh) == len(keys):
                break
            time.sleep(0.01)
        with self.flights.lock:
            return dict(self.stats)

    def _notify_finished(self, state: RequestState) -> None:
        for listener in self.finish_listeners:
            listener(state)
