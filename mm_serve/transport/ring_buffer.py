"""The cross-modal ring buffer: prefill -> decode hand-off of KV pages and patch features.

One ring per (prefill worker, decode worker) pair, in three shared-memory
segments named from :attr:`RingSpec.name`: ``-ctl`` (control block, hand-off
slots, release ring), ``-kv`` (the page pool) and ``-feat`` (the feature arena).
"""

from __future__ import annotations

import time
from types import MappingProxyType

import torch

from mm_serve.kernels.page_pool import PagePool
from mm_serve.transport.feature_arena import FeatureArena
from mm_serve.transport.ring_spec import (
    RING_MAGIC,
    ControlWord,
    Handoff,
    RingSpec,
    SlotStatus,
    control_views,
    read_payload,
    segment_sizes,
    write_payload,
)
from mm_serve.transport.shm_segment import ShmSegment, attach_segments, create_segments

__all__ = ["CrossModalRing", "Handoff"]

_TORCH_DTYPES = MappingProxyType(
    {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
)
_MAX_BACKOFF_S = 0.001  # longest sleep between reclaim polls of a blocked publish


class CrossModalRing:
    """Single-producer (prefill), single-consumer (decode) hand-off ring in shared memory.

    Sequence number ``s`` (0, 1, 2, ...) uses slot ``s % capacity`` with version
    (lap) ``s // capacity + 1``; version 0 means never published.

    Who writes what. Producer: a slot's payload and ``version``, its ``status``
    EMPTY->WRITING->READY and CLAIMED->EMPTY (in :meth:`reclaim`), control words
    WRITE_INDEX, RELEASE_TAIL, PAGES_FREE, FEATURE_ROWS_FREE, and the pages and
    feature rows it allocated until it publishes them; its allocators (a
    ``PagePool`` and a ``FeatureArena``) are local objects. Consumer: ``status``
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

    def __init__(self, spec: RingSpec, segments: list[ShmSegment]) -> None:
        """Wrap mapped segments "ctl", "kv", "feat" (in that order); use create / attach."""
        self.spec = spec
        self._segments = segments
        self._owner = segments[0].owner
        ctl, kv, feat = segments
        self._ctrl, self._slots, self._release = control_views(spec, ctl.buffer)
        dtype = _TORCH_DTYPES[spec.dtype]
        self._pages = kv.tensor(dtype, (spec.num_pages, *spec.page_shape))
        self._features = feat.tensor(dtype, (spec.feature_rows, spec.feature_dim))
        self._closed = False
        self._pool = PagePool(spec.num_pages)  # producer-local from here ...
        self._arena = FeatureArena(spec.feature_rows)
        self._unpublished_pages: set[int] = set()
        self._unpublished_features: set[tuple[int, int]] = set()
        self._in_flight: dict[int, Handoff] = {}  # seq -> published, not reclaimed
        self._claimed: set[int] = set()  # consumer-local: seqs claimed, not released

    @classmethod
    def create(cls, spec: RingSpec) -> CrossModalRing:
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
    def attach(cls, spec: RingSpec) -> CrossModalRing:
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

    def __enter__(self) -> CrossModalRing:
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
        if not 0 <= n <= self.spec.max_pages_per_handoff:
            raise ValueError(f"cannot hand off {n} pages (max {self.spec.max_pages_per_handoff})")
        if not self._pool.can_allocate(n) and not (self.reclaim() and self._pool.can_allocate(n)):
            return None
        page_ids = self._pool.allocate(n)
        self._unpublished_pages.update(page_ids)
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
        offset = self._arena.allocate(rows)
        if offset is None and self.reclaim():
            offset = self._arena.allocate(rows)
        if offset is not None:
            self._unpublished_features.add((offset, rows))
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
        self._check_unpublished(handoff.page_ids, handoff.feature_offset, handoff.feature_rows)
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
        slot["version"] = seq // self.spec.capacity + 1  # after the payload ...
        slot["status"] = SlotStatus.READY  # ... and before READY
        self._ctrl[ControlWord.WRITE_INDEX] = seq + 1
        self._unpublished_pages.difference_update(handoff.page_ids)
        self._unpublished_features.discard((handoff.feature_offset, handoff.feature_rows))
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
            self._pool.free(handoff.page_ids)
            if handoff.feature_rows:
                self._arena.free(handoff.feature_offset, handoff.feature_rows)
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
        self._check_unpublished(page_ids, feature_offset, feature_rows)
        self._unpublished_pages.difference_update(page_ids)
        self._pool.free(page_ids)
        if feature_rows:
            self._unpublished_features.discard((feature_offset, feature_rows))
            self._arena.free(feature_offset, feature_rows)
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
        lap = seq // self.spec.capacity + 1
        if self._slots["status"][index] != SlotStatus.READY or self._slots["version"][index] == lap:
            return None
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
        self._pool.check_integrity()
        self._arena.check_integrity()

    # internals -------------------------------------------------------------

    def _read(self, seq: int) -> Handoff | None:
        """Seqlock read of hand-off ``seq``: None unless its slot is READY at lap ``seq``."""
        index = seq % self.spec.capacity
        lap = seq // self.spec.capacity + 1
        status, version = self._slots["status"], self._slots["version"]
        if status[index] != SlotStatus.READY or version[index] != lap:
            return None
        snap = self._slots[index : index + 1].copy()[0]
        if status[index] != SlotStatus.READY or version[index] != lap or snap["seq"] != seq:
            return None  # changed while copying: not a consistent snapshot
        return read_payload(snap)

    def _check_unpublished(self, page_ids: list[int], feature_offset: int, feature_rows: int) -> None:
        """Raise ValueError unless the pages and the extent are allocated here and unpublished."""
        if len(set(page_ids)) != len(page_ids) or not self._unpublished_pages.issuperset(page_ids):
            raise ValueError(f"pages {page_ids} are not all allocated and unpublished")
        extent = (feature_offset, feature_rows)
        if feature_rows and extent not in self._unpublished_features:
            raise ValueError(f"feature extent {extent} is not allocated and unpublished")

    def _mirror_free(self) -> None:
        self._ctrl[ControlWord.PAGES_FREE] = self._pool.num_free
        self._ctrl[ControlWord.FEATURE_ROWS_FREE] = self._arena.num_free

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"ring {self.spec.name!r} is closed")
