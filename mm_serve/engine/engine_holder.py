"""Owns the :class:`EngineClient` of the API process: starts it in the background, reports health."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from mm_serve.config import ServiceConfig
from mm_serve.engine.engine_client import EngineClient


class EngineHolder:
    """Starts the workers without blocking the HTTP server, so ``/health`` can say "warming"."""

    def __init__(self, model_dir: Path, config: ServiceConfig, client: EngineClient | None = None,
                 start_now: bool = False) -> None:
        """``client``: an engine client started elsewhere, whose lifetime its owner keeps (the holder
        then reads as started); otherwise the holder makes one for ``model_dir`` and ``config``.
        ``start_now``: start the workers here (:meth:`start_background`), before the tokenizer and
        media processors load, so the worker processes start while this one loads them (``mm-serve
        serve``: about 2 s of a start); the caller then owns a :meth:`stop` on every path.

        Raises:
            CheckpointError: the model, its tokenizer or its media processor cannot be read (workers
                started here are stopped first).
        """
        self.model_dir = model_dir
        self.config = config
        if client is None:
            client = EngineClient(model_dir, config, defer_inputs=start_now)
        self.client = client
        self.model_config = client.model_config
        self.start_error: str | None = None
        self.start_user_error = False  # the start failed for what the user gave (WorkerStartError.user_error)
        self.ready_event = threading.Event()
        if client.router is not None:
            self.ready_event.set()
        self.draining = threading.Event()  # set on SIGTERM/SIGINT: new requests get 503
        self.unavailable = client.flights.unavailable  # set once a role's workers are all down for good
        self.drain_deadline = 0.0  # time.monotonic() by which a drain under way stops the workers
        self.drain_ended = threading.Event()  # set when a drain ends: what is still held is answered 503
        self._drain_cut = threading.Event()  # set by :meth:`cut_drain`: a drain under way ends now
        self._thread: threading.Thread | None = None
        if start_now:
            self.start_background()
        try:
            self.inputs = client.inputs
        except BaseException:
            if self._thread is not None:
                self.stop()
            raise

    def start_background(self) -> None:
        """Start the workers on a thread (``/health`` says "warming" meanwhile); once only, later calls
        do nothing."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._start, name="mm-serve-engine-start", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        try:
            self.client.start()
            self.ready_event.set()
        except Exception as exc:  # reported through /health and the CLI
            self.start_error = str(exc)
            self.start_user_error = bool(getattr(exc, "user_error", False))
            self.ready_event.set()

    @property
    def ready(self) -> bool:
        """Whether calls are taken and a path serves now: the first start is over (:attr:`started`: the
        pool counts as ready once one prefill and one decode worker are, before every worker is) and
        :meth:`EngineClient.is_ready`."""
        return self.started and self.client.is_ready

    @property
    def started(self) -> bool:
        """Whether the first start succeeded (later faults are the pool's to repair)."""
        return self.ready_event.is_set() and self.start_error is None and self.client.router is not None

    @property
    def unavailable_reason(self) -> str:
        """Why no request can be served any more, once :attr:`unavailable` is set (which role has no worker)."""
        return self.client.flights.unavailable_reason

    def health(self) -> tuple[str, dict[str, str], dict[str, str]]:
        """(status, per-worker status, last fault per worker).

        Status: ``ok`` (every worker ready), ``degraded`` (a worker is restarting or down but a
        prefill and a decode path serve; 200), ``warming`` (first start), ``stopping`` (a
        SIGTERM/SIGINT drain runs, so load balancers stop sending traffic), ``down`` (no path
        serves, or the start failed). Only ``ok`` and ``degraded`` are HTTP 200.
        """
        if self.start_error is not None:
            return "down", {"engine": f"failed to start: {self.start_error.splitlines()[0]}"}, {}
        info = self.client.health()
        workers: dict[str, str] = info["workers"] or {"engine": "warming"}
        faults: dict[str, str] = info["faults"]
        if self.draining.is_set():
            return "stopping", workers, faults
        if not self.started:
            return "warming", workers, faults
        return info["status"], workers, faults

    def drain(self, grace_s: float, admitting: Callable[[], int] = lambda: 0) -> int:
        """Stop admitting, then wait up to ``grace_s`` seconds for in-flight engine requests to
        finish, and for the calls ``admitting()`` counts (past the front end's check for a drain, not
        yet submitted: a call still decoding its images is answered 503 once done, one in the dispatch
        hold is submitted when it leaves) to get that far, or for :meth:`cut_drain`; returns how many
        of both were left when it ended, and sets :attr:`drain_ended` (a call still held then is
        answered 503)."""
        deadline = time.monotonic() + grace_s
        self.drain_deadline = deadline
        self.draining.set()
        while (self.client.requests or admitting()) and time.monotonic() < deadline and not self._drain_cut.is_set():
            time.sleep(0.05)
        left = len(self.client.requests) + admitting()
        self.drain_ended.set()
        return left

    def cut_drain(self) -> None:
        """End a drain under way now (a second signal): :meth:`drain` returns within 50 ms."""
        self.drain_deadline = time.monotonic()
        self._drain_cut.set()

    def fail_in_flight(self, message: str) -> int:
        """End every engine request still in flight with the error ``message``, before the workers stop:
        a stream's last event is then that error and a non-streamed call gets a 503, instead of a
        connection cut when the server exits. Returns how many there were. Takes the flight table's
        lock: not for a signal handler (it may have interrupted a holder of that lock)."""
        left = len(self.client.requests)
        self.client.flights.fail_all(message)
        return left

    def stop(self) -> None:
        self.client.request_stop()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.client.shutdown()
