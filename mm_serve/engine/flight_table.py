"""The requests in flight on the workers: dispatch, abort, and migration after a fault.

Each request is a :class:`~mm_serve.engine.flight.Flight` whose current attempt has a wire
id. Dispatching routes the attempt (:class:`~mm_serve.engine.router.Router`), counts it in the
:class:`~mm_serve.engine.load_ledger.LoadLedger` and sends it to a ready prefill (or colocated)
worker; while its role has no ready worker but one restarting, the flight is *parked*. When a
worker fails, every request that depended on it is migrated:

* prefill (or colocated) worker: the requests it had queued, was prefilling, or had
  prefilled but whose hand-off no decode worker has reported taking;
* decode worker: every request routed to it, whatever its stage;
* a hand-off a decode worker refused (:class:`~mm_serve.runtime.messages.HandoffFailed`).

A migrated request goes to a ready worker, or is parked; past ``fault.max_migrations`` it fails
with a message naming the fault. Every method that mutates runs under :attr:`FlightTable.lock`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

from mm_serve.cluster.worker_pool import WorkerFailure, WorkerPool
from mm_serve.config import ServiceConfig
from mm_serve.engine.flight import Flight
from mm_serve.engine.load_ledger import LoadLedger
from mm_serve.engine.request_state import RequestState
from mm_serve.engine.router import Router
from mm_serve.ground.roles import Role
from mm_serve.ground.tiers import Tier
from mm_serve.runtime import messages
from mm_serve.runtime.kv_cache import pages_for


class FlightTable:
    """The unfinished requests of one engine client and where each runs.

    Attributes:
        requests: request id -> :class:`RequestState` of every unfinished request.
        unavailable: set once every worker of a role the requests need is down for good (past
            ``fault.max_restarts``): no request can be served any more.
        fault_counts: ``(kind, role)`` -> count, kinds ``request_migrations`` (requests moved
            after a fault of a worker of that role), ``handoff_failures`` (hand-offs refused
            by decode), ``requests_failed_by_fault`` (requests ended with an error by a fault).
    """

    def __init__(self, pool: WorkerPool, config: ServiceConfig, notify: Callable[[RequestState], None]) -> None:
        self.pool = pool
        self.config = config
        self.colocated = pool.colocated
        self.lock = threading.RLock()
        self.requests: dict[str, RequestState] = {}
        self.fault_counts: Counter[tuple[str, str]] = Counter()
        self.router: Router | None = None  # set once the workers are ready
        self.ledger: LoadLedger | None = None
        self._notify = notify
        self.unavailable = threading.Event()  # set once every worker of a role the requests need is down for good
        self.unavailable_reason = ""  # then: which role
        self._flights: dict[str, Flight] = {}  # request id -> flight
        self._wire: dict[str, Flight] = {}  # wire id of the current attempt -> flight
        # the ledger lists queued looser requests for the promise rule only where it can act (no
        # per-view scan of the prefill queues otherwise): prediction and admission.protect_admitted on
        self._promises_kept = config.admission.predict and config.admission.protect_admitted

    @property
    def prefill_role(self) -> Role:
        """The role that prefills: the colocated worker in colocated mode."""
        return Role.COLOCATED if self.colocated else Role.PREFILL

    def ready_candidates(self) -> tuple[list[int], list[int]]:
        """(prefill-side, decode-side) indices of the ready workers (the colocated worker is both)."""
        prefills = self.pool.ready_indices(self.prefill_role)
        return prefills, prefills if self.colocated else self.pool.ready_indices(Role.DECODE)

    def decode_pages(self, prompt_tokens: int, max_tokens: int) -> int:
        """KV pages a request of ``prompt_tokens`` tokens needs for ``max_tokens`` more on its decode worker."""
        return pages_for(prompt_tokens + max_tokens, self.config.kv_cache.page_size)

    def parked(self) -> list[Flight]:
        """The flights waiting for a worker of a role that is restarting. Call under the lock."""
        return [f for f in self._flights.values() if f.parked]

    def check_recoverable(self) -> None:
        """Raises:
            RuntimeError: every worker of a role the requests need is down for good."""
        for role in [self.prefill_role] if self.colocated else [Role.PREFILL, Role.DECODE]:
            if not self.pool.may_recover(role):
                raise RuntimeError(f"the service is not available: every {role} worker is down "
                                   "(past fault.max_restarts); see /health")

    def add(self, flight: Flight) -> None:
        """Take a new request and dispatch it (or park it).

        Raises:
            ValueError: a request with its id is in flight already.
        """
        with self.lock:
            if flight.request_id in self.requests:
                raise ValueError(f"duplicate request id {flight.request_id!r}")
            self.requests[flight.request_id] = flight.state
            self._flights[flight.request_id] = flight
            self._dispatch(flight)

    def _dispatch(self, flight: Flight) -> None:
        """Send the flight's current attempt to ready workers, or park it. Call under the lock."""
        assert self.router is not None and self.ledger is not None
        prefills, decodes = self.ready_candidates()
        if not prefills or not decodes:
            flight.parked = True
            flight.state.delayed_by_fault = True
            return
        n = len(flight.first.prompt_token_ids) + flight.base
        prefill = self.router.pick_prefill(prefills, flight.page_hashes, n)
        decode = prefill if self.colocated else self.router.pick_decode(
            self.decode_pages(n, flight.remaining_tokens()), decodes)
        flight.parked = False
        flight.prefill, flight.decode = prefill, decode
        self._wire[flight.wire_id] = flight
        tokens, images = self.router.work_left(prefill, n, flight.first.num_images, flight.page_hashes,
                                               flight.first.image_hashes, flight.first.image_tiles)
        self.ledger.dispatched(flight.wire_id, prefill, decode, tokens, self.decode_pages(n, 1),
                               Tier.clamp(flight.first.priority), images,
                               0.0 if self.colocated else flight.first.max_wait_s,  # colocated: no ageing
                               arrived_at=flight.state.arrival_time if self._promises_kept else None)
        # not delivered when the worker died a moment ago: supervision finds it and migrates this flight
        self.pool.send((self.prefill_role, prefill), flight.message(decode, time.time()))

    def dispatch_parked(self) -> None:
        """Dispatch the parked flights (a worker became ready)."""
        with self.lock:
            for flight in self.parked():
                self._dispatch(flight)

    def abort(self, request_id: str) -> RequestState | None:
        """Forget a request wherever it is (the workers drop it and free its pages); returns its
        state, None when it is not in flight."""
        with self.lock:
            state = self.requests.pop(request_id, None)
            flight = self._flights.pop(request_id, None)
            if flight is not None:
                self._drop_attempt(flight)
        return state

    def _drop_attempt(self, flight: Flight) -> None:
        """Forget the flight's current attempt: the ledger forgets it, the workers that may hold
        it drop it (prefill queue, ring, decode). Call under the lock."""
        assert self.ledger is not None
        wire_id = flight.wire_id
        self._wire.pop(wire_id, None)
        self.ledger.finished(wire_id)
        if flight.parked or flight.prefill is None:
            return
        msg = messages.AbortRequest(wire_id)
        self.pool.send((self.prefill_role, flight.prefill), msg)
        if not self.colocated and flight.decode is not None:
            self.pool.send((Role.DECODE, flight.decode), msg)

    def on_failure(self, failure: WorkerFailure) -> None:
        """Move every request that depended on the failed worker (see the module docstring)."""
        role, index = Role(failure.key[0]), failure.key[1]
        with self.lock:
            if self.ledger is not None and role.decodes:
                self.ledger.reset_decode(index)
            if self.ledger is not None and self.router is not None and role.prefills:
                self.ledger.reset_prefill(index)
                self.router.forget_prefill(index)
            if role == Role.DECODE:
                hit = [f for f in self._flights.values() if not f.parked and f.decode == index]
            else:
                hit = [f for f in self._flights.values()
                       if not f.parked and f.prefill == index and (role == Role.COLOCATED or not f.claimed)]
            for flight in hit:
                self._migrate(flight, f"{role} worker {index} {failure.reason}", role)
            if failure.down:
                self._fail_unrecoverable(role)

    def on_handoff_failed(self, wire_id: str, reason: str) -> None:
        """A decode worker refused the hand-off of ``wire_id``: move its request."""
        with self.lock:
            flight = self._wire.get(wire_id)
            if flight is not None:
                self.fault_counts["handoff_failures", Role.DECODE.value] += 1
                self._migrate(flight, f"its hand-off was refused ({reason})", Role.DECODE)

    def on_request_failed(self, wire_id: str, message: str) -> None:
        """A worker's step failed the request of ``wire_id``: end it with ``message``."""
        with self.lock:
            flight = self._wire.get(wire_id)
            if flight is not None:
                self._drop_attempt(flight)
                self._finish_failed(flight, message)

    def _migrate(self, flight: Flight, reason: str, role: Role) -> None:
        """Resubmit the flight's request from what it has received, or fail it past
        ``fault.max_migrations``. Call under the lock."""
        self._drop_attempt(flight)
        limit = self.config.fault.max_migrations
        if flight.migrations >= limit:
            self.fault_counts["requests_failed_by_fault", role.value] += 1
            self._finish_failed(flight, f"{reason}; the request was moved {flight.migrations} time(s) already "
                                        f"(fault.max_migrations = {limit})")
            return
        self.fault_counts["request_migrations", role.value] += 1
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
        self._notify(flight.state)

    def _fail_unrecoverable(self, role: Role) -> None:
        """After a worker of ``role`` went down for good: when no worker of a role the
        requests need is left, fail every request. Call under the lock."""
        try:
            self.check_recoverable()
        except RuntimeError as exc:
            self.unavailable_reason = str(exc)
            self.unavailable.set()
            for flight in list(self._flights.values()):
                self._drop_attempt(flight)
                self.fault_counts["requests_failed_by_fault", role.value] += 1
                self._finish_failed(flight, str(exc))

    def on_update(self, role: Role, update: messages.TokenUpdate) -> None:
        """Apply a token update of a current attempt (stale ones are dropped); a request it
        finishes leaves the table, and one finished here by a stop string is dropped on the workers."""
        with self.lock:
            flight = self._wire.get(update.request_id)
            if flight is None:
                return  # finished, aborted, or an attempt replaced after a fault
            assert self.ledger is not None
            if role.prefills:
                self.ledger.prefilled(update.request_id)
            if role.decodes:
                self.ledger.claimed(update.request_id)
                flight.claimed = True
            update.start_index += flight.base
        state = flight.state
        if not state.apply(update):
            return
        with self.lock:
            if self._flights.get(flight.request_id) is flight:
                del self._flights[flight.request_id]
                self.requests.pop(flight.request_id, None)
            if update.finish_reason is None:  # finished here by a stop string: stop the workers
                self._drop_attempt(flight)
            else:
                self._wire.pop(flight.wire_id, None)
                self.ledger.finished(flight.wire_id)
        self._notify(state)

    def fail_all(self, message: str) -> None:
        """End every request with ``message`` (the service is stopping)."""
        with self.lock:
            states = list(self.requests.values())
            self.requests.clear()
            self._flights.clear()
            self._wire.clear()
        for state in states:
            state.fail(message)
            self._notify(state)
