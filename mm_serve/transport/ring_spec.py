"""Shape, name and shared-memory layout of one cross-modal ring buffer; the hand-off record.

A :class:`RingSpec` is what the creating side sends to the other side in a
control message (msgspec-encoded); from it both sides derive the same segment
names, the same slot layout (:func:`slot_dtype`) and the same control-block
word offsets. :func:`write_payload` / :func:`read_payload` move a
:class:`Handoff` in and out of a slot; the protocol around them (status,
version, indices) is :class:`mm_serve.transport.ring_buffer.CrossModalRing`'s. No torch here.
"""

from __future__ import annotations

import mmap
import re
import uuid
from dataclasses import dataclass
from enum import IntEnum
from types import MappingProxyType

import msgspec
import numpy as np

DTYPE_BYTES = MappingProxyType({"float32": 4, "bfloat16": 2, "float16": 2})
"""Element size in bytes of each KV / feature dtype a ring supports."""

REQUEST_ID_BYTES = 64
"""Longest request id (UTF-8 bytes) a slot holds."""

CACHE_LINE = 64
"""Bytes; hot counters written by different processes sit on different lines."""

TRANSPORTS = ("shm", "ray")
"""How a ring moves hand-offs: a shared-memory segment (same node) or Ray's object store (across nodes)."""

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,200}")


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


@dataclass
class Handoff:
    """One prefilled request handed from prefill to decode."""

    request_id: str  # <= 64 UTF-8 bytes
    page_ids: list[int]  # ring pool pages holding the KV, in token order
    num_kv_tokens: int  # tokens whose KV is in the pages (= prompt length)
    first_token: int  # token sampled by prefill
    feature_offset: int  # first row in the feature arena (0 with no features)
    feature_rows: int  # 0 for text-only requests
    meta: bytes  # opaque caller-encoded payload, <= spec.meta_bytes
    seq: int = -1  # ring sequence number, filled by publish / peek / claim


class RingSpec(msgspec.Struct, frozen=True):
    """Everything both sides need to create or attach the same ring.

    Fields are validated on construction and on msgspec decode (``ValueError``
    naming the bad value; msgspec wraps it in ``msgspec.ValidationError``).
    """

    name: str  # unique shm name prefix, e.g. unique_ring_name("p0d0")
    num_pages: int  # KV pages in the pool
    page_shape: tuple[int, ...]  # (num_layers, 2, page_size, num_kv_heads, head_dim)
    dtype: str  # "float32" | "bfloat16" | "float16"
    feature_rows: int  # rows in the feature arena (0: text-only, no features)
    feature_dim: int  # hidden size of projected patch embeddings
    capacity: int  # hand-off slots, power of two
    max_pages_per_handoff: int  # page-id array length of a slot
    meta_bytes: int  # per-slot opaque payload size (msgpack of token ids + sampling params)
    transport: str = "shm"  # "shm": this ring in shared memory; "ray": the same protocol over Ray (other nodes)
    producer: str = ""  # transport "ray": Ray actor name of the prefill end
    consumer: str = ""  # transport "ray": Ray actor name of the decode end

    def __post_init__(self) -> None:
        if not isinstance(self.page_shape, tuple):  # a list from Python callers: normalise
            msgspec.structs.force_setattr(self, "page_shape", tuple(self.page_shape))
        if not _NAME_RE.fullmatch(self.name):
            raise ValueError(f"ring name must match {_NAME_RE.pattern}, got {self.name!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if len(self.page_shape) != 5 or self.page_shape[1] != 2 or min(self.page_shape) < 1:
            raise ValueError(
                "page_shape must be (num_layers, 2, page_size, num_kv_heads, head_dim) "
                f"with positive sizes, got {self.page_shape}"
            )
        if self.capacity < 1 or self.capacity & (self.capacity - 1):
            raise ValueError(f"capacity must be a power of two, got {self.capacity}")
        if self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if not 1 <= self.max_pages_per_handoff <= self.num_pages:
            raise ValueError(
                f"max_pages_per_handoff must be in [1, num_pages={self.num_pages}], "
                f"got {self.max_pages_per_handoff}"
            )
        if self.feature_rows < 0 or self.feature_dim < 1:
            raise ValueError(
                f"need feature_rows >= 0 and feature_dim >= 1, got {self.feature_rows}, {self.feature_dim}"
            )
        if self.meta_bytes < 0:
            raise ValueError(f"meta_bytes must be >= 0, got {self.meta_bytes}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.transport == "ray" and not (self.producer and self.consumer):
            raise ValueError("a ring over Ray needs the actor names of both ends (producer, consumer)")

    @property
    def page_size(self) -> int:
        """Tokens per KV page."""
        return self.page_shape[2]

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``."""
        return DTYPE_BYTES[self.dtype]

    @property
    def page_bytes(self) -> int:
        """Bytes of one KV page (all layers, keys and values)."""
        return int(np.prod(self.page_shape)) * self.itemsize

    def segment_name(self, part: str) -> str:
        """POSIX shm name (no leading slash) of segment ``part``: "ctl", "kv" or "feat"."""
        return f"{self.name}-{part}"

    def check_handoff(self, handoff: Handoff) -> bytes:
        """The UTF-8 request id, once ``handoff``'s sizes fit this ring's slots.

        Raises:
            ValueError: request id or meta too long, more pages than allowed, page
                count not ``ceil(num_kv_tokens / page_size)``, or a feature offset
                without features.
        """
        rid = handoff.request_id.encode()
        if len(rid) > REQUEST_ID_BYTES or len(handoff.meta) > self.meta_bytes:
            raise ValueError(
                f"request id ({len(rid)} B) or meta ({len(handoff.meta)} B) too long "
                f"(max {REQUEST_ID_BYTES} B, {self.meta_bytes} B)"
            )
        n = len(handoff.page_ids)
        needed = -(-handoff.num_kv_tokens // self.page_size)
        if n > self.max_pages_per_handoff or handoff.num_kv_tokens < 0 or n != needed:
            raise ValueError(f"{handoff.num_kv_tokens} KV tokens do not fill exactly {n} pages")
        if not handoff.feature_rows and handoff.feature_offset:
            raise ValueError(f"feature_offset must be 0 without features, got {handoff.feature_offset}")
        return rid

    def fingerprint(self) -> int:
        """A 63-bit digest of the whole spec; attach refuses a segment created from another spec."""
        digest = uuid.uuid5(uuid.NAMESPACE_OID, repr(msgspec.structs.astuple(self)))
        return digest.int & ((1 << 63) - 1)


def unique_ring_name(tag: str) -> str:
    """A name prefix no other ring on this host uses, e.g. ``mmsrv-1f2e3d4c5b6a-p0d0``."""
    return f"mmsrv-{uuid.uuid4().hex[:12]}-{tag}"


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
