"""Where a worker's Ray actor and its serving loop meet: inboxes of the Ray hand-off transport.

A worker that runs as a Ray actor (:mod:`mm_serve.cluster.ray_worker`) serves its loop on
one thread while Ray runs the actor's other methods (``deliver``, ``released``) on other
threads. Those methods only append to this object's inboxes, keyed by ring name; the
serving loop takes what is there when its :class:`~mm_serve.transport.ray_ring.RayRing`
peeks or reclaims. Outbound, the link calls the peer actor's methods by name (handles are
looked up once and cached).

Nothing here blocks the serving loop: sends are Ray's asynchronous actor calls. A send to a
peer that has died fails in Ray, not here; the front end's supervision replaces that peer
and the ring (``ReplaceRing``), and :meth:`close` of the old ring drops what it still had.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

import zmq

PEER_LOOKUP_S = 30.0  # how long a named peer actor may take to appear (it is created just before)


class RayLink:
    """Inboxes per ring name (deliveries for a consumer, releases for a producer) and the
    outbound calls to peer actors in Ray namespace ``namespace``."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._lock = threading.Lock()
        self._deliveries: dict[str, list[tuple[bytes, Any]]] = defaultdict(list)
        self._releases: dict[str, list[int]] = defaultdict(list)
        self._closed: set[str] = set()
        self._peers: dict[str, Any] = {}
        self._wake: zmq.Socket | None = None  # type: ignore[type-arg]

    # ---- inbound: Ray's threads ---------------------------------------------------------------

    def deliver(self, ring: str, record: bytes, refs: list[Any]) -> None:
        """A producer published hand-off ``record`` on ``ring``; ``refs[0]`` is its payload's
        object ref (passed nested, so Ray counts this side as a borrower). Wakes the loop."""
        with self._lock:
            if ring in self._closed:
                return
            self._deliveries[ring].append((record, refs[0]))
            if self._wake is not None:
                try:
                    self._wake.send(b"", zmq.NOBLOCK)
                except zmq.Again:
                    pass

    def released(self, ring: str, seq: int) -> None:
        """The consumer of ``ring`` released hand-off ``seq``."""
        with self._lock:
            if ring not in self._closed:
                self._releases[ring].append(seq)

    # ---- the serving loop ---------------------------------------------------------------------

    def take_deliveries(self, ring: str) -> list[tuple[bytes, Any]]:
        """Every delivery of ``ring`` not taken yet, in arrival order (not always seq order)."""
        with self._lock:
            return self._deliveries.pop(ring, [])

    def take_releases(self, ring: str) -> list[int]:
        """Every release of ``ring`` not taken yet."""
        with self._lock:
            return self._releases.pop(ring, [])

    def close(self, ring: str) -> None:
        """Drop what ``ring`` still has queued (its object refs with it) and ignore later calls."""
        with self._lock:
            self._closed.add(ring)
            self._deliveries.pop(ring, None)
            self._releases.pop(ring, None)

    def wake_with(self, address: str) -> None:
        """Ring the doorbell bound at ``address`` (in this process) on every delivery, so an
        idle decode loop claims at once instead of after its idle timeout."""
        sock: zmq.Socket = zmq.Context.instance().socket(zmq.PUSH)  # type: ignore[type-arg]
        sock.setsockopt(zmq.SNDHWM, 2)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        with self._lock:
            self._wake = sock

    def shutdown(self) -> None:
        """Close the doorbell socket; later deliveries are dropped."""
        with self._lock:
            if self._wake is not None:
                self._wake.close(linger=0)
                self._wake = None
            self._closed.update(self._deliveries)
            self._deliveries.clear()
            self._releases.clear()

    # ---- outbound -----------------------------------------------------------------------------

    def send_delivery(self, peer: str, ring: str, record: bytes, ref: Any) -> None:
        """Call ``deliver`` on actor ``peer`` (asynchronously)."""
        self._peer(peer).deliver.remote(ring, record, [ref])

    def send_release(self, peer: str, ring: str, seq: int) -> None:
        """Call ``released`` on actor ``peer`` (asynchronously)."""
        self._peer(peer).released.remote(ring, seq)

    def _peer(self, name: str) -> Any:
        handle = self._peers.get(name)
        if handle is None:
            import ray

            deadline = time.monotonic() + PEER_LOOKUP_S
            while True:
                try:
                    handle = ray.get_actor(name, namespace=self.namespace)
                    break
                except ValueError:  # not registered yet
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            self._peers[name] = handle
        return handle
