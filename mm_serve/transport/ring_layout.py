"""The shared-memory layout of a cross-modal ring: control block, hand-off slots, release ring.

Both ends derive the same layout from the same :class:`~mm_serve.transport.ring_spec.RingSpec`:
the segment sizes (:func:`segment_sizes`), the slot layout (:func:`slot_dtype`) and the
control-block word offsets (:class:`ControlWord`). :func:`write_payload` /
:func:`read_payload` move a :class:`~mm_serve.transport.ring_spec.Handoff` in and out of a
slot; the protocol around them (status, version, indices) is
:class:`mm_serve.transport.shm_ring.ShmRing`'s. No torch here.
"""

from __future__ import annotations

import mmap
from enum import IntEnum

import numpy as np

from mm_serve.transport.ring_spec import REQUEST_ID_BYTES, Handoff, RingSpec

CACHE_LINE = 64
"""Bytes; hot counters written by different processes sit on different lines."""


class SlotStatus(IntEnum):
    """Life cycle of one hand-off slot: EMPTY -> WRITING -> READY -> CLAIMED -> EMPTY."""

    EMPTY = 0  # free for the producer (initial state: zero-filled segment)
    WRITING = 1  # producer is filling the payload
    READY = 2  # payload and version written; the consumer may claim it
    CLAIMED = 3  # consumer took it; pages stay reserved until it releases them


class ControlWord(IntEnum):
    """Index (in u64 words) of each field of the control block at the start of the ring segment.

    Writers: ``MAGIC``/``FINGERPRINT`` by the creator once; ``WRITE_INDEX``,
    ``RELEASE_TAIL``, ``PAGES_FREE`` and ``FEATURE_ROWS_FREE`` by the producer;
    ``READ_INDEX`` and ``RELEASE_HEAD`` by the consumer. Each counter written by
    one side sits on its own cache line (8 words) so the two never false-share.
    """

    MAGIC = 0
    FINGERPRINT = 1
    WRITE_INDEX = 8  # hand-offs published (next sequence number to publish)
    READ_INDEX = 16  # hand-offs claimed (next sequence number to claim)
    RELEASE_HEAD = 24  # sequence numbers pushed to the release ring
    RELEASE_TAIL = 32  # release-ring entries reclaimed by the producer
    PAGES_FREE = 40  # mirror of the producer's free page count (observability)
    FEATURE_ROWS_FREE = 41  # mirror of the producer's free feature rows


CONTROL_WORDS = 64
"""Size of the control block in u64 words (8 cache lines)."""

RING_MAGIC = 0x4D4D5352_52494E47  # "MMSRRING"


def lap(seq: int, capacity: int) -> int:
    """The version a slot carries while it holds hand-off ``seq``: ``seq // capacity + 1``
    (0 marks a slot never published)."""
    return seq // capacity + 1


def slot_dtype(spec: RingSpec) -> np.dtype:
    """numpy structured dtype of one hand-off slot, padded to whole cache lines.

    Word-sized fields are naturally aligned, so each is written by one store.
    """
    ids_off = 2 * CACHE_LINE
    meta_off = ids_off + 8 * spec.max_pages_per_handoff
    size = meta_off + max(spec.meta_bytes, 1)
    fields = {
        "status": ("<u4", 0),  # SlotStatus
        "request_id_len": ("<u4", 4),
        "version": ("<u8", 8),  # lap number: seq // capacity + 1, 0 = never published
        "seq": ("<u8", 16),
        "num_kv_tokens": ("<i8", 24),
        "first_token": ("<i8", 32),
        "feature_offset": ("<i8", 40),
        "feature_rows": ("<i8", 48),
        "num_pages": ("<u4", 56),
        "meta_len": ("<u4", 60),
        "request_id": (("<u1", REQUEST_ID_BYTES), CACHE_LINE),
        "page_ids": (("<i8", spec.max_pages_per_handoff), ids_off),
        "meta": (("<u1", max(spec.meta_bytes, 1)), meta_off),
    }
    return np.dtype({
        "names": list(fields),
        "formats": [fmt for fmt, _ in fields.values()],
        "offsets": [off for _, off in fields.values()],
        "itemsize": -(-size // CACHE_LINE) * CACHE_LINE,
    })


def segment_sizes(spec: RingSpec) -> dict[str, int]:
    """Bytes of each segment of the ring by shm name, in order "-ctl", "-kv", "-feat" (>= 1 each)."""
    return {
        spec.segment_name("ctl"): control_segment_bytes(spec)[2],
        spec.segment_name("kv"): spec.num_pages * spec.page_bytes,
        spec.segment_name("feat"): max(spec.feature_rows * spec.feature_dim * spec.itemsize, 1),
    }


def control_segment_bytes(spec: RingSpec) -> tuple[int, int, int]:
    """Byte offsets of (slots, release ring) and the total size of the control segment."""
    slots_off = CONTROL_WORDS * 8
    release_off = slots_off + spec.capacity * slot_dtype(spec).itemsize
    return slots_off, release_off, release_off + spec.capacity * 8


def write_payload(slot: np.void, handoff: Handoff, request_id: bytes, seq: int) -> None:
    """Store every field of ``handoff`` (UTF-8 ``request_id``) and ``seq`` in ``slot``,
    a view of one slot; status and version are left to the caller (they go last)."""
    n = len(handoff.page_ids)
    slot["request_id"][: len(request_id)] = np.frombuffer(request_id, np.uint8)
    slot["request_id_len"] = len(request_id)
    slot["page_ids"][:n] = handoff.page_ids
    slot["num_pages"] = n
    slot["meta"][: len(handoff.meta)] = np.frombuffer(handoff.meta, np.uint8)
    slot["meta_len"] = len(handoff.meta)
    slot["num_kv_tokens"] = handoff.num_kv_tokens
    slot["first_token"] = handoff.first_token
    slot["feature_offset"] = handoff.feature_offset
    slot["feature_rows"] = handoff.feature_rows
    slot["seq"] = seq


def read_payload(snap: np.void) -> Handoff:
    """The hand-off stored in ``snap``, a private copy of one slot.

    Raises:
        UnicodeDecodeError: the request id bytes are not UTF-8 (corrupted slot).
    """
    return Handoff(
        request_id=snap["request_id"][: snap["request_id_len"]].tobytes().decode(),
        page_ids=snap["page_ids"][: snap["num_pages"]].tolist(),
        num_kv_tokens=int(snap["num_kv_tokens"]),
        first_token=int(snap["first_token"]),
        feature_offset=int(snap["feature_offset"]),
        feature_rows=int(snap["feature_rows"]),
        meta=snap["meta"][: snap["meta_len"]].tobytes(),
        seq=int(snap["seq"]),
    )


def control_views(spec: RingSpec, buffer: mmap.mmap) -> tuple[np.ndarray, ...]:
    """numpy views of the ``-ctl`` segment: control words ``[CONTROL_WORDS]`` u64, slots
    ``[capacity]`` of :func:`slot_dtype`, release ring ``[capacity]`` u64 (sequence numbers)."""
    slots_off, release_off, _ = control_segment_bytes(spec)
    return (
        np.frombuffer(buffer, np.uint64, CONTROL_WORDS),
        np.frombuffer(buffer, slot_dtype(spec), spec.capacity, slots_off),
        np.frombuffer(buffer, np.uint64, spec.capacity, release_off),
    )
