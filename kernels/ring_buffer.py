"""The cross-modal ring buffer: prefill -> decode hand-off of KV pages and patch features.

One ring per (prefill worker, decode worker) pair, in three shared-memory
segments named from :class:`~kernels.ring_spec.RingSpec.name`: ``-ctl`` (control
block, hand-off slots, release ring), ``-kv`` (the page pool) and ``-feat`` (the
feature arena). See :class:`CrossModalRing` for the protocol.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from kernels.feature_arena import FeatureArena
from kernels.ring_spec import (
    CONTROL_WORDS, REQUEST_ID_BYTES, RING_MAGIC, ControlWord, RingSpec, SlotStatus,
    control_segment_bytes, slot_dtype,
)
from kernels.shm_segment import ShmSegment
from text_decode.page_pool import PagePool

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MAX_BACKOFF_S = 0.002  # longest sleep between reclaim polls of a blocked publish


class CrossModalRing:
    """Single-producer (prefill), single-consumer (decode) hand-off ring in shared memory.

    Sequence number ``s`` (0, 1, 2, ...) uses slot ``s % capacity`` with version
    (lap) ``s // capacity + 1``; version 0 means never published.

    Who writes what:

    * producer: slot payload, ``version``, ``status`` EMPTY->WRITING->READY and
      CLAIMED->EMPTY (in :meth:`reclaim`), and the control words WRITE_INDEX,
      RELEASE_TAIL, PAGES_FREE, FEATURE_ROWS_FREE; the pages and feature rows
      it allocated, until publish. The allocators are producer-local objects.
    * consumer: ``status`` READY->CLAIMED, READ_INDEX, the release ring entries
      and RELEASE_HEAD. It only reads slot payloads, pages and features.

    Publish order: status=WRITING; payload (ids, pages list, feature extent,
    meta, seq); version=lap; status=READY; WRITE_INDEX=s+1. The consumer takes
    ``R = READ_INDEX`` only if the slot's status is READY *and* its version is
    ``R // capacity + 1``, copies the slot, then re-reads status and version and
    discards the copy unless both still match (seqlock). A slot whose version
    does not match is never consumed. Why a reader never sees a half-written
    slot: the producer writes a slot only while it is EMPTY/WRITING (never while
    READY or CLAIMED, because it reuses slot ``s % capacity`` only after the
    consumer released hand-off ``s - capacity`` and :meth:`reclaim` set it
    EMPTY), and it stores the payload strictly before version and READY. Each
    store here is a separate call into numpy (no compiler can reorder them) of
    an aligned word (no tearing), and x86-64 is TSO: stores become visible to
    other cores in program order and loads are not reordered with older loads,
    so a reader that sees READY and the right version sees the whole payload.
    A port to a weaker memory model (ARM, POWER, a GPU) needs a release fence
    (store-release) before the READY / index stores and an acquire fence
    (load-acquire) after reading READY / versions / indices, e.g. C11 atomics.

    Release ring: the consumer writes released sequence numbers at
    ``RELEASE_HEAD % capacity`` then bumps RELEASE_HEAD; the producer's
    :meth:`reclaim` reads up to it, frees the pages and feature extent, marks the
    slot EMPTY and bumps RELEASE_TAIL. It cannot overflow: at most ``capacity``
    hand-offs are published and not reclaimed. Releases may come in any order.

    Backpressure: a full page pool or arena makes :meth:`alloc_pages` /
    :meth:`alloc_features` return None; a full ring makes :meth:`publish` wait
    (polling :meth:`reclaim` with a sleep backoff of up to 2 ms) and return False
    after ``timeout``. Nothing is ever dropped. Exactly one process may call the
    producer methods and one the consumer methods (may be the same instance).
    """

    def __init__(self, spec: RingSpec, segments: dict[str, ShmSegment]) -> None:
        self.spec = spec
        self._segments = segments
        self._owner = segments["ctl"].owner
        buf = segments["ctl"].buffer
        slots_off, release_off, _ = control_segment_bytes(spec)
        self._ctrl = np.frombuffer(buf, np.uint64, CONTROL_WORDS)
        self._slots = np.frombuffer(buf, slot_dtype(spec), spec.capacity, slots_off)
        self._release = np.frombuffer(buf, np.uint64, spec.capacity, release_off)
        dtype = _TORCH_DTYPES[spec.dtype]
        self._pages = _tensor_view(segments["kv"], dtype, (spec.num_pages, *spec.page_shape))
        self._features = _tensor_view(segments["feat"], dtype, (spec.feature_rows, spec.feature_dim))
        self._closed = False
        # producer-local state
        self._pool = PagePool(spec.num_pages)
        self._arena = FeatureArena(spec.feature_rows)
        self._unpublished_pages: set[int] = set()
        self._unpublished_features: set[tuple[int, int]] = set()
        self._in_flight: dict[int, Handoff] = {}  # seq -> published, not reclaimed
        # consumer-local state
        self._claimed: set[int] = set()

    @classmethod
    def create(cls, spec: RingSpec) -> CrossModalRing:
        """Create and zero-fill the ring's segments (this side owns and later unlinks them).

        Raises:
            FileExistsError: a segment with this ring's name exists (nothing is left behind).
        """
        sizes = _segment_sizes(spec)
        segments: dict[str, ShmSegment] = {}
        try:
            for part, size in sizes.items():
                segments[part] = ShmSegment.create(spec.segment_name(part), size)
        except BaseException:
            for segment in segments.values():
                segment.unlink()
            raise
        ring = cls(spec, segments)
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
            ValueError: the segments were created from a different spec.
        """
        segments = {
            part: ShmSegment.attach(spec.segment_name(part), size)
            for part, size in _segment_sizes(spec).items()
        }
        ring = cls(spec, segments)
        ctrl = ring._ctrl
        if ctrl[ControlWord.MAGIC] != RING_MAGIC or ctrl[ControlWord.FINGERPRINT] != spec.fingerprint():
            ring.close()
            raise ValueError(f"ring {spec.name!r} was created from another spec (or is not initialised)")
        return ring

    def close(self) -> None:
        """Drop this side's views of the segments; idempotent. Tensors the caller still
        holds keep their memory mapped until freed. The ring's methods raise afterwards."""
        if self._closed:
            return
        self._closed = True
        del self._ctrl, self._slots, self._release, self._pages, self._features
        for segment in self._segments.values():
            segment.close()

    def unlink(self) -> None:
        """Remove every ``/dev/shm`` segment of this ring (owner only; idempotent).

        Raises:
            RuntimeError: called on an attached (non-owner) ring.
        """
        if not self._owner:
            raise RuntimeError(f"ring {self.spec.name!r}: only the creating side may unlink")
        for segment in self._segments.values():
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
        if not self._pool.can_allocate(n):
            self.reclaim()
            if not self._pool.can_allocate(n):
                return None
        page_ids = self._pool.allocate(n)
        self._unpublished_pages.update(page_ids)
        self._mirror_free()
        return page_ids

    def alloc_features(self, rows: int) -> int | None:
        """Offset of ``rows`` contiguous free arena rows (0 if ``rows`` is 0), or None if no room.

        Raises:
            ValueError: ``rows`` is negative or exceeds the arena.
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
        """Publish ``handoff`` (its pages/features already written); sets ``handoff.seq``.

        Waits up to ``timeout`` seconds (None: forever) for a free slot. Returns
        False if the ring stayed full; the allocations stay with the caller.

        Raises:
            ValueError: the hand-off is malformed or references pages / a feature
                extent not allocated by :meth:`alloc_pages` / :meth:`alloc_features`
                or already published.
        """
        self._require_open()
        rid, meta = self._validate(handoff)
        seq = int(self._ctrl[ControlWord.WRITE_INDEX])
        index = seq % self.spec.capacity
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff = 1e-5
        while self._slots["status"][index] != SlotStatus.EMPTY:
            if self.reclaim():
                continue
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(backoff)
            backoff = min(2 * backoff, _MAX_BACKOFF_S)
        slot = self._slots[index]
        slot["status"] = SlotStatus.WRITING
        n = len(handoff.page_ids)
        slot["request_id"][: len(rid)] = np.frombuffer(rid, np.uint8)
        slot["request_id_len"] = len(rid)
        slot["page_ids"][:n] = handoff.page_ids
        slot["num_pages"] = n
        slot["meta"][: len(meta)] = np.frombuffer(meta, np.uint8)
        slot["meta_len"] = len(meta)
        for field in ("num_kv_tokens", "first_token", "feature_offset", "feature_rows"):
            slot[field] = getattr(handoff, field)
        slot["seq"] = seq
        slot["version"] = seq // self.spec.capacity + 1  # after the payload ...
        slot["status"] = SlotStatus.READY  # ... and before READY
        self._ctrl[ControlWord.WRITE_INDEX] = seq + 1
        self._unpublished_pages.difference_update(handoff.page_ids)
        self._unpublished_features.discard((handoff.feature_offset, handoff.feature_rows))
        handoff.seq = seq
        self._in_flight[seq] = handoff
        return True

    def reclaim(self) -> int:
        """Free the pages and features of released hand-offs and empty their slots.

        Returns the number of hand-offs reclaimed.

        Raises:
            RuntimeError: the release ring names a hand-off that is not claimed
                and in flight (a protocol violation or corrupted shared memory).
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
            ValueError: a page or the extent is not allocated-and-unpublished (nothing freed).
        """
        self._require_open()
        if not self._unpublished_pages.issuperset(page_ids) or len(set(page_ids)) != len(page_ids):
            raise ValueError(f"pages {page_ids} are not all allocated and unpublished")
        extent = (feature_offset, feature_rows)
        if feature_rows and extent not in self._unpublished_features:
            raise ValueError(f"feature extent {extent} is not allocated and unpublished")
        self._unpublished_pages.difference_update(page_ids)
        self._pool.free(page_ids)
        if feature_rows:
            self._unpublished_features.discard(extent)
            self._arena.free(feature_offset, feature_rows)
        self._mirror_free()

    # consumer side ---------------------------------------------------------

    def peek(self) -> Handoff | None:
        """The next READY hand-off in order (with meta), without claiming it; else None."""
        self._require_open()
        return self._read(int(self._ctrl[ControlWord.READ_INDEX]))

    def claim(self) -> Handoff | None:
        """Claim the next READY hand-off: the consumer now owns it until :meth:`release`."""
        self._require_open()
        seq = int(self._ctrl[ControlWord.READ_INDEX])
        handoff = self._read(seq)
        if handoff is None:
            return None
        self._slots["status"][seq % self.spec.capacity] = SlotStatus.CLAIMED
        self._ctrl[ControlWord.READ_INDEX] = seq + 1
        self._claimed.add(seq)
        return handoff

    def release(self, handoff: Handoff) -> None:
        """Return a claimed hand-off's pages and features (after copying them out).

        Raises:
            ValueError: ``handoff`` was not claimed from this instance, or was released already.
        """
        self._require_open()
        if handoff.seq not in self._claimed:
            raise ValueError(f"hand-off seq {handoff.seq} is not claimed (or already released)")
        self._claimed.remove(handoff.seq)
        head = int(self._ctrl[ControlWord.RELEASE_HEAD])
        self._release[head % self.spec.capacity] = handoff.seq  # entry first ...
        self._ctrl[ControlWord.RELEASE_HEAD] = head + 1  # ... then publish it

    # observability -----------------------------------------------------------

    def slots_used(self) -> int:
        """Hand-offs published and not yet reclaimed (either side may ask)."""
        self._require_open()
        return int(self._ctrl[ControlWord.WRITE_INDEX]) - int(self._ctrl[ControlWord.RELEASE_TAIL])

    def pages_free(self) -> int:
        """Free pool pages as of the producer's last allocation or reclaim (either side may ask)."""
        self._require_open()
        return int(self._ctrl[ControlWord.PAGES_FREE])

    def check_integrity(self) -> None:
        """Check the producer-side allocators (see ``PagePool`` / ``FeatureArena``).

        Raises:
            AssertionError: an allocator invariant is broken.
        """
        self._pool.check_integrity()
        self._arena.check_integrity()

    # internals -------------------------------------------------------------

    def _read(self, seq: int) -> Handoff | None:
        """Seqlock read of hand-off ``seq``: None unless its slot is READY with the right version."""
        index = seq % self.spec.capacity
        lap = seq // self.spec.capacity + 1
        if not self._ready(index, lap):
            return None
        snap = self._slots[index : index + 1].copy()[0]
        if not self._ready(index, lap) or snap["version"] != lap or snap["seq"] != seq:
            return None
        rid = snap["request_id"][: snap["request_id_len"]].tobytes().decode()
        return Handoff(
            request_id=rid,
            page_ids=snap["page_ids"][: snap["num_pages"]].tolist(),
            num_kv_tokens=int(snap["num_kv_tokens"]),
            first_token=int(snap["first_token"]),
            feature_offset=int(snap["feature_offset"]),
            feature_rows=int(snap["feature_rows"]),
            meta=snap["meta"][: snap["meta_len"]].tobytes(),
            seq=seq,
        )

    def _ready(self, index: int, lap: int) -> bool:
        return bool(self._slots["status"][index] == SlotStatus.READY
                    and self._slots["version"][index] == lap)

    def _validate(self, handoff: Handoff) -> tuple[bytes, bytes]:
        rid = handoff.request_id.encode()
        if len(rid) > REQUEST_ID_BYTES or len(handoff.meta) > self.spec.meta_bytes:
            raise ValueError(
                f"request id ({len(rid)} B) or meta ({len(handoff.meta)} B) too long "
                f"(max {REQUEST_ID_BYTES} B, {self.spec.meta_bytes} B)"
            )
        pages = handoff.page_ids
        if len(pages) != -(-handoff.num_kv_tokens // self.spec.page_size) or handoff.num_kv_tokens < 0:
            raise ValueError(f"{handoff.num_kv_tokens} KV tokens do not fill exactly {len(pages)} pages")
        if len(set(pages)) != len(pages) or not self._unpublished_pages.issuperset(pages):
            raise ValueError(f"pages {pages} are not all allocated and unpublished")
        extent = (handoff.feature_offset, handoff.feature_rows)
        if handoff.feature_rows and extent not in self._unpublished_features:
            raise ValueError(f"feature extent {extent} is not allocated and unpublished")
        if not handoff.feature_rows and handoff.feature_offset:
            raise ValueError(f"feature_offset must be 0 without features, got {handoff.feature_offset}")
        return rid, handoff.meta

    def _mirror_free(self) -> None:
        self._ctrl[ControlWord.PAGES_FREE] = self._pool.num_free
        self._ctrl[ControlWord.FEATURE_ROWS_FREE] = self._arena.num_free

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"ring {self.spec.name!r} is closed")


def _segment_sizes(spec: RingSpec) -> dict[str, int]:
    """Bytes of the "ctl", "kv" and "feat" segments (each at least 1 byte)."""
    feature_bytes = spec.feature_rows * spec.feature_dim * spec.itemsize
    return {
        "ctl": control_segment_bytes(spec)[2],
        "kv": spec.num_pages * spec.page_bytes,
        "feat": max(feature_bytes, 1),
    }


def _tensor_view(segment: ShmSegment, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``shape`` over the start of ``segment`` (keeps the mapping alive)."""
    count = int(np.prod(shape))
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(segment.buffer, dtype=dtype, count=count).view(shape)
