"""The cross-modal ring's protocol between two Ray actors on different nodes.

Same contract as :class:`mm_serve.transport.shm_ring.ShmRing` (see
:class:`~mm_serve.transport.base.HandoffRing`), other memory:

* **Producer** (prefill actor): a local staging pool of ``spec.num_pages`` pages and
  ``spec.feature_rows`` feature rows with the same allocator as the shared ring
  (:class:`~mm_serve.transport.staging.StagingArea`), so a full pool is backpressure
  exactly as there. :meth:`RayRing.publish` puts the hand-off's
  pages and features into the local Ray object store (``ray.put``: one copy) and sends the
  decode actor a :class:`RayHandoffRecord` with the object ref. At most ``spec.capacity``
  hand-offs are published and not released (a full ring: ``publish`` returns False).
  The staging pages stay reserved, and the object alive (this side owns it), until the
  consumer releases the hand-off; then :meth:`RayRing.reclaim` frees both.
* **Consumer** (decode actor): records wait in arrival order by sequence number; nothing
  is transferred until :meth:`RayRing.claim`, which the receiver calls only when the
  decode worker has room (pull-based, as on one node). ``claim`` fetches the object
  (``ray.get``: Ray's object manager pulls it from the producer's node) into a local
  landing area at the same page ids and rows, so the receiver copies from
  ``pages[page_ids]`` as it does from the shared ring; :meth:`RayRing.release` tells the
  producer.

Checks: each record carries the spec's fingerprint (the ring generation and layout; a
record from another generation or layout is taken out by :meth:`RayRing.discard_corrupt`
and its request recomputed) and its sequence number; the payload checksum in the
hand-off meta (CRC-32, :mod:`mm_serve.transport.handoff_checksum`) is checked by the receiver over
the landed bytes, as on one node. A payload that cannot be fetched (its owner died) is
taken out the same way.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, ClassVar

import msgspec
import numpy as np
import torch

from mm_serve.ground.dtypes import torch_dtype
from mm_serve.transport.base import Side
from mm_serve.transport.ray_link import RayLink
from mm_serve.transport.ring_spec import Handoff, RingSpec, TransportName
from mm_serve.transport.staging import StagingArea

_BACKOFF_S = 0.001  # sleep between reclaims of a publish that waits for a slot


class RayHandoffRecord(msgspec.Struct, frozen=True):
    """What the producer sends the consumer per hand-off (the payload travels as an object ref)."""

    seq: int  # 0, 1, 2, ... per ring
    fingerprint: int  # RingSpec.fingerprint() of the producer's ring
    request_id: str
    page_ids: list[int]  # staging pages of the producer = landing pages of the consumer
    num_kv_tokens: int
    first_token: int
    feature_offset: int
    feature_rows: int
    meta: bytes  # the caller's meta (token ids, sampling, checksum), as in a ring slot


class RayRing:
    """One (prefill, decode) pair's hand-offs over Ray; one instance per side."""

    name: ClassVar[TransportName] = "ray"
    same_node: ClassVar[bool] = False

    def __init__(self, spec: RingSpec, link: RayLink, side: Side) -> None:
        """Raises ``ValueError`` for a spec of another transport."""
        if spec.transport != self.name:
            raise ValueError(f"ring {spec.name!r} has transport {spec.transport!r}, not {self.name!r}")
        self.spec = spec
        self.side = side
        self._link = link
        self._fingerprint = spec.fingerprint()
        dtype = torch_dtype(spec.dtype)
        self._pages = torch.zeros((spec.num_pages, *spec.page_shape), dtype=dtype)
        self._features = torch.zeros((spec.feature_rows, spec.feature_dim), dtype=dtype)
        self._closed = False
        # producer
        self._staging = StagingArea(spec)
        self._in_flight: dict[int, tuple[Handoff, Any]] = {}  # seq -> (hand-off, object ref)
        self._next_seq = 0
        # consumer
        self._received: dict[int, tuple[RayHandoffRecord, Any]] = {}
        self._read_seq = 0
        self._skip: set[int] = set()  # seqs taken out as corrupt before their turn
        self._corrupt: deque[Handoff] = deque()
        self._claimed: dict[int, Handoff] = {}
        self.num_pulled = 0  # hand-offs fetched through the object store (consumer)
        self.bytes_pulled = 0

    @classmethod
    def host(cls, spec: RingSpec) -> None:
        """Nothing for the front end to create: the two actors hold the ring."""
        return None

    @classmethod
    def open(cls, spec: RingSpec, side: Side, link: RayLink | None) -> RayRing:
        """Actor ``side``'s end of ring ``spec``, through the actor's ``link``.

        Raises:
            ValueError: ``link`` is None (this worker is not a Ray actor), or ``spec`` is
                not a Ray ring.
        """
        if link is None:
            raise ValueError(f"ring {spec.name!r} runs over Ray, but this worker is not a Ray actor")
        return cls(spec, link, side)

    # ---- views --------------------------------------------------------------------------------

    @property
    def pages(self) -> torch.Tensor:
        """``[num_pages, *page_shape]``: staging (producer) or landing (consumer) pages."""
        self._require_open()
        return self._pages

    @property
    def features(self) -> torch.Tensor:
        """``[feature_rows, feature_dim]``: staging or landing feature rows."""
        self._require_open()
        return self._features

    # ---- producer -----------------------------------------------------------------------------

    def alloc_pages(self, n: int) -> list[int] | None:
        """``n`` free staging pages (reclaiming released hand-offs first if short), or None.

        Raises:
            ValueError: ``n`` is outside ``[0, max_pages_per_handoff]``.
        """
        self._require_open()
        return self._staging.alloc_pages(n, self.reclaim)

    def alloc_features(self, rows: int) -> int | None:
        """Offset of ``rows`` contiguous free staging rows (0 for 0 rows), or None."""
        self._require_open()
        return self._staging.alloc_features(rows, self.reclaim)

    def free_unpublished(self, page_ids: list[int], feature_offset: int, feature_rows: int) -> None:
        """Give back the allocations of a hand-off that will not be published.

        Raises:
            ValueError: a page or the extent is not allocated and unpublished.
        """
        self._require_open()
        self._staging.free_unpublished(page_ids, feature_offset, feature_rows)

    def publish(self, handoff: Handoff, timeout: float | None = 0.0) -> bool:
        """Put the hand-off's staged pages and features into the object store and send the
        record to the consumer; sets ``handoff.seq``. Waits up to ``timeout`` seconds (None:
        forever) while ``spec.capacity`` hand-offs are unreleased; False if none was released.

        Raises:
            ValueError: as :meth:`ShmRing.publish <mm_serve.transport.shm_ring.ShmRing.publish>`.
        """
        import ray

        self._require_open()
        self.spec.check_handoff(handoff)
        self._staging.check_unpublished(handoff.page_ids, handoff.feature_offset, handoff.feature_rows)
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self._in_flight) >= self.spec.capacity:
            if self.reclaim():
                continue
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(_BACKOFF_S)
        rows = slice(handoff.feature_offset, handoff.feature_offset + handoff.feature_rows)
        payload = (_raw(self._pages[handoff.page_ids]), _raw(self._features[rows]))
        ref = ray.put(payload)
        seq = self._next_seq
        record = RayHandoffRecord(
            seq=seq, fingerprint=self._fingerprint, request_id=handoff.request_id, page_ids=list(handoff.page_ids),
            num_kv_tokens=handoff.num_kv_tokens, first_token=handoff.first_token,
            feature_offset=handoff.feature_offset, feature_rows=handoff.feature_rows, meta=handoff.meta,
        )
        self._link.send_delivery(self.spec.consumer, self.spec.name, msgspec.msgpack.encode(record), ref)
        self._next_seq = seq + 1
        self._staging.mark_published(handoff)
        handoff.seq = seq
        self._in_flight[seq] = (handoff, ref)
        return True

    def reclaim(self) -> int:
        """Free the staging pages, features and objects of released hand-offs; return how many.

        Raises:
            RuntimeError: a release names a hand-off that is not in flight.
        """
        self._require_open()
        released = self._link.take_releases(self.spec.name)
        for seq in released:
            item = self._in_flight.pop(seq, None)
            if item is None:
                raise RuntimeError(f"ring {self.spec.name!r}: released seq {seq} is not in flight")
            self._staging.free_released(item[0])
        return len(released)

    # ---- consumer -----------------------------------------------------------------------------

    def peek(self) -> Handoff | None:
        """The next delivered hand-off in sequence order, not claimed; None if it has not arrived."""
        self._require_open()
        self._take_deliveries()
        while self._read_seq in self._skip:
            self._skip.remove(self._read_seq)
            self._read_seq += 1
        item = self._received.get(self._read_seq)
        return None if item is None else _handoff(item[0])

    def claim(self) -> Handoff | None:
        """Claim the next hand-off and fetch its payload into ``pages[page_ids]`` and the
        feature rows; None if none is there, or if the fetch failed (the hand-off is then
        returned by :meth:`discard_corrupt`)."""
        import ray
        from ray.exceptions import RayError

        handoff = self.peek()
        if handoff is None:
            return None
        seq = handoff.seq
        _, ref = self._received.pop(seq)
        self._read_seq = seq + 1
        try:
            pages, features = ray.get(ref)
        except RayError:
            self._claimed[seq] = handoff
            self.release(handoff)
            self._corrupt.append(handoff)
            return None
        del ref
        _land(self._pages, handoff.page_ids, pages)
        if handoff.feature_rows:
            _land(self._features, slice(handoff.feature_offset, handoff.feature_offset + handoff.feature_rows),
                  features)
        self._claimed[seq] = handoff
        self.num_pulled += 1
        self.bytes_pulled += int(pages.nbytes) + int(features.nbytes)
        return handoff

    def release(self, handoff: Handoff) -> None:
        """Hand a claimed hand-off's room back to the producer.

        Raises:
            ValueError: ``handoff`` was not claimed here, or was released already.
        """
        self._require_open()
        if self._claimed.pop(handoff.seq, None) is None:
            raise ValueError(f"hand-off seq {handoff.seq} is not claimed (or already released)")
        self._link.send_release(self.spec.producer, self.spec.name, handoff.seq)

    def discard_corrupt(self) -> Handoff | None:
        """The next hand-off taken out (and released) because its record was of another ring
        generation or layout, or its payload could not be fetched; None when there is none."""
        self._require_open()
        self._take_deliveries()
        return self._corrupt.popleft() if self._corrupt else None

    # ---- both ---------------------------------------------------------------------------------

    def slots_used(self) -> int:
        """Hand-offs published and not released, as this side knows them."""
        self._require_open()
        if self.side == "producer":
            return len(self._in_flight)
        return len(self._received) + len(self._claimed)

    def pages_free(self) -> int:
        """Free staging pages (producer); landing pages not held by a delivered hand-off (consumer)."""
        self._require_open()
        if self.side == "producer":
            return self._staging.pages_free
        held = sum(len(r.page_ids) for r, _ in self._received.values())
        return self.spec.num_pages - held - sum(len(h.page_ids) for h in self._claimed.values())

    def check_integrity(self) -> None:
        """Check the producer's allocators; AssertionError if an invariant is broken."""
        self._staging.check_integrity()

    def close(self) -> None:
        """Drop this side's state and object refs (idempotent); methods raise RuntimeError after."""
        if not self._closed:
            self._closed = True
            self._link.close(self.spec.name)
            self._in_flight.clear()
            self._received.clear()

    # ---- internals ----------------------------------------------------------------------------

    def _take_deliveries(self) -> None:
        for raw, ref in self._link.take_deliveries(self.spec.name):
            record = msgspec.msgpack.decode(raw, type=RayHandoffRecord)
            if record.fingerprint != self._fingerprint or record.seq < self._read_seq:
                handoff = _handoff(record)
                self._claimed[record.seq] = handoff
                self.release(handoff)
                self._corrupt.append(handoff)
                if record.seq >= self._read_seq:
                    self._skip.add(record.seq)
                continue
            self._received[record.seq] = (record, ref)

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"ring {self.spec.name!r} is closed")


def _raw(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of ``tensor`` as a contiguous uint8 array (any dtype, bfloat16 included)."""
    return tensor.contiguous().view(torch.uint8).numpy()


def _land(dest: torch.Tensor, index: Any, raw: np.ndarray) -> None:
    """Copy bytes fetched by :func:`_raw` into ``dest[index]`` (same shape, same dtype)."""
    dest.view(torch.uint8).numpy()[index] = raw


def _handoff(record: RayHandoffRecord) -> Handoff:
    return Handoff(
        request_id=record.request_id, page_ids=list(record.page_ids), num_kv_tokens=record.num_kv_tokens,
        first_token=record.first_token, feature_offset=record.feature_offset, feature_rows=record.feature_rows,
        meta=record.meta, seq=record.seq,
    )
