"""The engine client's receiver thread: worker messages in, request states and stats out.

It reads every message the workers send to the front end (token updates, batch starts,
stats, readiness, refused hand-offs, failed requests), applies each to the
:class:`~mm_serve.engine.flight_table.FlightTable`, and every
:data:`SUPERVISE_INTERVAL_S` runs the pool's supervision, migrating the requests of a
worker that failed. A bug in handling one message is printed and the loop goes on, so one
bad update never stops every other request's delivery.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable

from mm_serve.cluster.worker_pool import WorkerKey, WorkerPool
from mm_serve.engine.flight_table import FlightTable
from mm_serve.ground.roles import Role
from mm_serve.runtime import messages

SUPERVISE_INTERVAL_S = 0.1  # how often the receiver thread runs the pool's supervision
RECV_TIMEOUT_MS = 50


class Receiver:
    """Runs the loop above on a daemon thread until the pool stops.

    Attributes:
        stats: (role, index) -> the latest :class:`~mm_serve.runtime.messages.WorkerStats` of each worker.
        step_listeners: called with (role, index, timing) for every timed worker step, on this thread.
    """

    def __init__(self, pool: WorkerPool, flights: FlightTable) -> None:
        self.pool = pool
        self.flights = flights
        self.stats: dict[WorkerKey, messages.WorkerStats] = {}
        self.stats_time: dict[WorkerKey, float] = {}  # monotonic receipt time of each worker's stats
        self.step_listeners: list[Callable[[str, int, messages.StepTiming], None]] = []
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread."""
        self._thread = threading.Thread(target=self._loop, name="mm-serve-receiver", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds for the thread to end (after the pool was asked to stop)."""
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        next_check = 0.0
        while not self.pool.stopping.is_set():
            msg = self.pool.recv(RECV_TIMEOUT_MS)
            if msg is not None:
                try:
                    self._handle(msg)
                except Exception:  # a bug in one update must not stop every other request's delivery
                    traceback.print_exc()
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + SUPERVISE_INTERVAL_S
                try:
                    for failure in self.pool.supervise():
                        self.on_failure_stats(failure.key)
                        self.flights.on_failure(failure)
                except Exception:
                    traceback.print_exc()

    def _handle(self, msg: object) -> None:
        if not self.pool.observe(msg):
            return
        if isinstance(msg, messages.TokenBatch):
            role = Role(msg.role)
            for update in msg.updates:
                self.flights.on_update(role, update)
            if msg.step is not None:
                for listener in self.step_listeners:
                    listener(msg.role, msg.index, msg.step)
        elif isinstance(msg, messages.PrefillStarted):
            with self.flights.lock:
                if self.flights.ledger is not None:
                    self.flights.ledger.batch_started(msg.index, msg.request_ids)
        elif isinstance(msg, messages.WorkerStats):
            self.on_stats(msg)
        elif isinstance(msg, messages.WorkerReady):
            self.flights.dispatch_parked()
        elif isinstance(msg, messages.HandoffFailed):
            self.flights.on_handoff_failed(msg.request_id, msg.reason)
        elif isinstance(msg, messages.RequestFailed):
            self.flights.on_request_failed(msg.request_id, msg.message)

    def on_stats(self, msg: messages.WorkerStats) -> None:
        """Keep a worker's stats; a decode-side worker's pages and running count go to the ledger."""
        with self.flights.lock:
            key = (msg.role, msg.index)
            self.stats[key] = msg
            self.stats_time[key] = time.monotonic()
            if self.flights.ledger is not None and Role(msg.role).decodes:
                self.flights.ledger.update_decode_stats(msg.index, msg.kv_pages_used, msg.kv_pages_total, msg.running)

    def on_failure_stats(self, key: WorkerKey) -> None:
        """A worker failed: forget its stats (its restart reports afresh)."""
        with self.flights.lock:
            self.stats.pop(key, None)
            self.stats_time.pop(key, None)
