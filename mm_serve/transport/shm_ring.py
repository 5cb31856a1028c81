"""The cross-modal ring in shared memory: the hand-off transport of a pair on one node.

One ring per (prefill worker, decode worker) pair, in three shared-memory
segments named from :attr:`RingSpec.name`: ``-ctl`` (control block, hand-off
slots, release ring; :mod:`mm_serve.transport.ring_layout`), ``-kv`` (the page
pool) and ``-feat`` (the feature arena). The front end creates the segments
(:meth:`ShmRing.host`) and unlinks them; both workers attach them (:meth:`ShmRing.open`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, ClassVar

import torch

from mm_serve.ground.dtypes import torch_dtype
from mm_serve.transport.base import Side
from mm_serve.transport.ring_layout import (
    RING_MAGIC,
    ControlWord,
    SlotStatus,
    control_views,
    lap,
    read_payload,
    segment_sizes,
    write_payload,
)
from mm_serve.transport.ring_spec import Handoff, RingSpec, TransportName
from mm_serve.transport.shm_segment import ShmSegment, attach_segments, create_segments
from mm_serve.transport.staging import StagingArea

if TYPE_CHECKING:
    from mm_serve.transport.ray_link import RayLink

_MAX_BACKOFF_S = 0.001  # longest sleep between reclaim polls of a blocked publish


class ShmRing:
    """Single-producer (prefill), single-consumer (decode) hand-off ring in shared memory.

    Sequence number ``s`` (0, 1, 2, ...) uses slot ``s % capacity`` with version
    (lap) ``s // capacity + 1``; version 0 means never published.

    Who writes what. Producer: a slot's payload and ``version``, its ``status``
    EMPTY->WRITING->READY and CLAIMED->EMPTY (in :meth:`reclaim`), control words
    WRITE_INDEX, RELEASE_TAIL, PAGES_FREE, FEATURE_ROWS_FREE, and the pages and
    feature rows it allocated until it publishes them; its allocators (a
    :class:`~mm_serve.transport.staging.StagingArea`) are local objects. Consumer: ``status``
    READY->CLAIMED, READ_INDEX, release-ring entries and RELEASE_HEAD; it only
    reads payloads, pages and features.

    Publish order: status=WRITING; payload (request id, page ids, token counts,
    feature extent, meta, seq); version=lap; status=READY; WRITE_INDEX=s+1. The
    consumer takes ``R = READ_INDEX`` only if the slot's status is READY *and*
    its version is ``R // capacity + 1``; it copies the slot, then re-reads
    status and version and drops the copy unless both still match (seqlock). A
    slot whose version does not match is never consumed.

    Why a reader never sees a half-written slot: the producer writes a slot only
    while it is EMPTY or WRITING, never READY or CLAIMED (it reuses slot
    ``s % capacity`` only after the consumer released hand-off ``s - capacity``
    and :meth:`reclaim` set it EMPTY), and it stores the whole payload before
    the version and READY. Each store is a separate call into numpy (no compiler
    reorders them) of an aligned word (no tearing), and x86-64 is TSO: other
    cores see stores in program order and loads are not reordered with older
    loads, so a reader that sees READY with the right version sees the payload.
    A port to a weaker memory model (ARM, POWER, GPU) needs a store-release for
    READY / versions / indices and a load-acquire where they are read (C11
    atomics or explicit fences); the seqlock re-check alone is not enough there.

    Release ring: the consumer writes a released sequence number at
    ``RELEASE_HEAD % capacity``, then bumps RELEASE_HEAD; :meth:`reclaim` reads
    up to it, frees that hand-off's pages and feature extent, sets its slot
    EMPTY and bumps RELEASE_TAIL. It cannot overflow: at most ``capacity``
    hand-offs are published and not reclaimed. Releases may come in any order.

    Backpressure: a full page pool or arena makes :meth:`alloc_pages` /
    :meth:`alloc_features` return None; a full ring makes :meth:`publish` wait
    (polling :meth:`reclaim`, sleeping up to 1 ms between polls) and return False
    after ``timeout``. Nothing is dropped. One instance may call the producer
    methods and one the consumer methods (the same one in a single process).
    """

    name: ClassVar[TransportName] = "shm"
    same_node: ClassVar[bool] = True

    def __init__(self, spec: RingSpec, segments: list[ShmSegment]) -> None:
        """Wrap mapped segments "ctl", "kv", "feat" (in that order); use create / attach."""
        self.spec = spec
        self._segments = segments
        self._owner = segments[0].owner
        ctl, kv, feat = segments
        self._ctrl, self._slots, self._release = control_views(spec, ctl.buffer)
        dtype = torch_dtype(spec.dtype)
        self._pages = kv.tensor(dtype, (spec.num_pages, *spec.page_shape))
        self._features = feat.tensor(dtype, (spec.feature_rows, spec.feature_dim))
        self._closed = False
        self._staging = StagingArea(spec)  # producer-local from here ...
        self._in_flight: dict[int, Handoff] = {}  # seq -> published, not reclaimed
        self._claimed: set[int] = set()  # consumer-local: seqs claimed, not released

    @classmethod
    def host(cls, spec: RingSpec) -> ShmRing:
        """The front end's side of a pair's ring: the segments, created (see :meth:`create`)."""
        return cls.create(spec)

    @classmethod
    def open(cls, spec: RingSpec, side: Side, link: RayLink | None) -> ShmRing:
        """A worker's side of the ring: the segments the front end created, attached (see
        :meth:`attach`; ``side`` and ``link`` are not needed here)."""
        return cls.attach(spec)

    @classmethod
    def create(cls, spec: RingSpec) -> ShmRing:
        """Create the ring's zero-filled segments; this side owns them and must :meth:`unlink`.

        Raises:
            FileExistsError: a segment of this name exists (nothing is left behind).
        """
        ring = cls(spec, create_segments(segment_sizes(spec)))
        ring._ctrl[ControlWord.PAGES_FREE] = spec.num_pages
        ring._ctrl[ControlWord.FEATURE_ROWS_FREE] = spec.feature_rows
        ring._ctrl[ControlWord.FINGERPRINT] = spec.fingerprint()
        ring._ctrl[ControlWord.MAGIC] = RING_MAGIC  # last: the block is initialised
        return ring

    @classmethod
    def attach(cls, spec: RingSpec) -> ShmRing:
        """Map the segments another process created from the same ``spec``.

        Raises:
            FileNotFoundError: the ring does not exist (yet, or any more).
            ValueError: the segments were created from another spec (or are not initialised).
        """
        ring = cls(spec, attach_segments(segment_sizes(spec)))
        ctrl = ring._ctrl
        if ctrl[ControlWord.MAGIC] != RING_MAGIC or ctrl[ControlWord.FINGERPRINT] != spec.fingerprint():
            ring.close()
            raise ValueError(f"ring {spec.name!r} was created from another spec (or not initialised)")
        return ring

    def close(self) -> None:
        """Drop this side's views (both sides; idempotent); methods raise RuntimeError after.

        Tensors the caller still holds keep their memory mapped until they are freed.
        """
        if not self._closed:
            self._closed = True
            del self._ctrl, self._slots, self._release, self._pages, self._features
            for segment in self._segments:
                segment.close()

    def unlink(self) -> None:
        """Remove every ``/dev/shm`` segment of this ring (owner only; idempotent).

        Raises:
            RuntimeError: called on an attached (non-owner) ring.
        """
        if not self._owner:
            raise RuntimeError(f"ring {self.spec.name!r}: only the creating side may unlink")
        for segment in self._segments:
            segment.unlink()

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(self, *exc: object) -> None:
        """Close, and unlink if this side created the ring."""
        self.close()
        if self._owner:
            self.unlink()

    @property
    def pages(self) -> torch.Tensor:
        """``[num_pages, *page_shape]`` view of the shared page pool."""
        self._require_open()
        return self._pages

    @property
    def features(self) -> torch.Tensor:
        """``[feature_rows, feature_dim]`` view of the shared feature arena."""
        self._require_open()
        return self._features

    # producer side ---------------------------------------------------------

    def alloc_pages(self, n: int) -> list[int] | None:
        """``n`` free pool pages (reclaiming released hand-offs first if short), or None.

        Raises:
            ValueError: ``n`` is outside ``[0, max_pages_per_handoff]``.
        """
        self._require_open()
        page_ids = self._staging.alloc_pages(n, self.reclaim)
        if page_ids is not None:
            self._mirror_free()
        return page_ids

    def alloc_features(self, rows: int) -> int | None:
        """Offset of ``rows`` contiguous free arena rows (0 for 0 rows), or None if no room.

        Raises:
            ValueError: ``rows`` is negative or larger than the arena.
        """
        self._require_open()
        if rows == 0:
            return 0
        offset = self._staging.alloc_features(rows, self.reclaim)
        if offset is not None:
            self._mirror_free()
        return offset

    def publish(self, handoff: Handoff, timeout: float | None = 0.0) -> bool:
        """Publish ``handoff`` (pages/features already written) and set ``handoff.seq``.

        Waits up to ``timeout`` seconds (None: forever) for a free slot; False if
        the ring stayed full (the allocations stay with the caller, who retries).

        Raises:
            ValueError: the hand-off does not fit the slots (see ``RingSpec.check_handoff``)
                or names pages / an extent not allocated here or already published.
        """
        self._require_open()
        request_id = self.spec.check_handoff(handoff)
        self._staging.check_unpublished(handoff.page_ids, handoff.feature_offset, handoff.feature_rows)
        seq = int(self._ctrl[ControlWord.WRITE_INDEX])
        index = seq % self.spec.capacity
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff = 2e-5
        while self._slots["status"][index] != SlotStatus.EMPTY:
            if self.reclaim():
                continue
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(backoff)
            backoff = min(2 * backoff, _MAX_BACKOFF_S)
        slot = self._slots[index]
        slot["status"] = SlotStatus.WRITING
        write_payload(slot, handoff, request_id, seq)
        slot["version"] = lap(seq, self.spec.capacity)  # after the payload ...
        slot["status"] = SlotStatus.READY  # ... and before READY
        self._ctrl[ControlWord.WRITE_INDEX] = seq + 1
        self._staging.mark_published(handoff)
        handoff.seq = seq
        self._in_flight[seq] = handoff
        return True

    def reclaim(self) -> int:
        """Free the pages and features of released hand-offs, empty their slots; return how many.

        Raises:
            RuntimeError: the release ring names a hand-off that is not claimed and
                in flight (a protocol violation or corrupted shared memory).
        """
        self._require_open()
        tail = int(self._ctrl[ControlWord.RELEASE_TAIL])
        head = int(self._ctrl[ControlWord.RELEASE_HEAD])
        for position in range(tail, head):
            seq = int(self._release[position % self.spec.capacity])
            index = seq % self.spec.capacity
            handoff = self._in_flight.pop(seq, None)
            if handoff is None or self._slots["status"][index] != SlotStatus.CLAIMED:
                raise RuntimeError(f"ring {self.spec.name!r}: released seq {seq} is not claimed")
            self._staging.free_released(handoff)
            self._slots["status"][index] = SlotStatus.EMPTY
            self._ctrl[ControlWord.RELEASE_TAIL] = position + 1
        if head > tail:
            self._mirror_free()
        return head - tail

    def free_unpublished(self, page_ids: list[int], feature_offset: int, feature_rows: int) -> None:
        """Give back the allocations of a hand-off that will not be published (e.g. aborted).

        Raises:
            ValueError: a page or the extent is not allocated and unpublished (nothing freed).
        """
        self._require_open()
        self._staging.free_unpublished(page_ids, feature_offset, feature_rows)
        self._mirror_free()

    # consumer side ---------------------------------------------------------

    def peek(self) -> Handoff | None:
        """The next READY hand-off in order (meta included), not claimed; None if none."""
        self._require_open()
        return self._read(int(self._ctrl[ControlWord.READ_INDEX]))

    def claim(self) -> Handoff | None:
        """Claim the next READY hand-off (this side owns it until :meth:`release`); None if none."""
        self._require_open()
        seq = int(self._ctrl[ControlWord.READ_INDEX])
        handoff = self._read(seq)
        if handoff is not None:
            self._slots["status"][seq % self.spec.capacity] = SlotStatus.CLAIMED
            self._ctrl[ControlWord.READ_INDEX] = seq + 1
            self._claimed.add(seq)
        return handoff

    def discard_corrupt(self) -> Handoff | None:
        """Take the next slot out of the ring if it is READY at the wrong lap, and release it.

        The producer stores the version before READY, so a READY slot whose version is not
        ``READ_INDEX // capacity + 1`` is no write in progress: it is a corrupted (or
        mis-versioned) hand-off that :meth:`peek` would otherwise stall on for good. It is
        claimed and released at once (the producer gets its pages back) and never consumed.

        Returns:
            The slot as read (its ``request_id`` as stored, ``""`` when not UTF-8), with
            ``seq`` set; None when the head slot is not such a slot.
        """
        self._require_open()
        seq = int(self._ctrl[ControlWord.READ_INDEX])
        index = seq % self.spec.capacity
        want = lap(seq, self.spec.capacity)
        if self._slots["status"][index] != SlotStatus.READY or self._slots["version"][index] == want:
            return None  # status first: a READY slot's version is already stored
        snap = self._slots[index : index + 1].copy()[0]
        try:
            handoff = read_payload(snap)
        except (UnicodeDecodeError, ValueError):
            handoff = Handoff(request_id="", page_ids=[], num_kv_tokens=0, first_token=0, feature_offset=0,
                              feature_rows=0, meta=b"")
        handoff.seq = seq
        self._slots["status"][index] = SlotStatus.CLAIMED
        self._ctrl[ControlWord.READ_INDEX] = seq + 1
        self._claimed.add(seq)
        self.release(handoff)
        return handoff

    def release(self, handoff: Handoff) -> None:
        """Hand a claimed hand-off's pages and features back (after copying them out).

        Raises:
            ValueError: ``handoff`` was not claimed here, or was released already.
        """
        self._require_open()
        if handoff.seq not in self._claimed:
            raise ValueError(f"hand-off seq {handoff.seq} is not claimed (or already released)")
        self._claimed.remove(handoff.seq)
        head = int(self._ctrl[ControlWord.RELEASE_HEAD])
        self._release[head % self.spec.capacity] = handoff.seq  # the entry first ...
        self._ctrl[ControlWord.RELEASE_HEAD] = head + 1  # ... then make it visible

    # observability ---------------------------------------------------------

    def slots_used(self) -> int:
        """Hand-offs published and not yet released by the consumer (either side may
        ask; a released slot the producer has not reclaimed yet is not counted: it
        reclaims before it publishes, so the slot is as good as free)."""
        self._require_open()
        released = int(self._ctrl[ControlWord.RELEASE_HEAD])  # read first: it trails the write index
        return max(0, int(self._ctrl[ControlWord.WRITE_INDEX]) - released)

    def pages_free(self) -> int:
        """Free pool pages as of the producer's last allocation or reclaim (either side may ask)."""
        self._require_open()
        return int(self._ctrl[ControlWord.PAGES_FREE])

    def check_integrity(self) -> None:
        """Check the producer's allocators; AssertionError if an invariant is broken."""
        self._staging.check_integrity()

    # internals -------------------------------------------------------------

    def _read(self, seq: int) -> Handoff | None:
        """Seqlock read of hand-off ``seq``: None unless its slot is READY at lap ``seq``."""
        index = seq % self.spec.capacity
        want = lap(seq, self.spec.capacity)
        status, version = self._slots["status"], self._slots["version"]
        if status[index] != SlotStatus.READY or version[index] != want:
            return None
        snap = self._slots[index : index + 1].copy()[0]
        if status[index] != SlotStatus.READY or version[index] != want or snap["seq"] != seq:
            return None  # changed while copying: not a consistent snapshot
        return read_payload(snap)

    def _mirror_free(self) -> None:
        self._ctrl[ControlWord.PAGES_FREE] = self._staging.pages_free
        self._ctrl[ControlWord.FEATURE_ROWS_FREE] = self._staging.feature_rows_free

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"ring {self.spec.name!r} is closed")
