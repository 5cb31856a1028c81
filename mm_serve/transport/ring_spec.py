"""Shape, name and transport of one cross-modal ring; the hand-off record it carries.

A :class:`RingSpec` is what the front end sends both ends of a (prefill, decode) pair
(msgspec-encoded, inside their worker specs or a ``ReplaceRing``); from it each end opens
the same ring of the same transport (:mod:`mm_serve.transport.registry`). A
:class:`Handoff` is one prefilled request in that ring: its page ids, token counts,
feature extent and the caller's meta. The shared-memory layout of a ring is
:mod:`mm_serve.transport.ring_layout`. No torch here.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Literal, get_args

import msgspec
import numpy as np

from mm_serve.ground.dtypes import DTYPE_BYTES, DTypeName

REQUEST_ID_BYTES = 64
"""Longest request id (UTF-8 bytes) a hand-off carries."""

TransportName = Literal["shm", "ray"]
"""How a ring moves hand-offs: a shared-memory segment (same node) or Ray's object store
(across nodes); :data:`mm_serve.transport.registry.TRANSPORTS` has the class of each."""

TRANSPORT_NAMES: tuple[TransportName, ...] = get_args(TransportName)

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,200}")


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
    dtype: DTypeName  # element type of the pages and features
    feature_rows: int  # rows in the feature arena (0: text-only, no features)
    feature_dim: int  # hidden size of projected patch embeddings
    capacity: int  # hand-off slots, power of two
    max_pages_per_handoff: int  # page-id array length of a slot
    meta_bytes: int  # per-slot opaque payload size (msgpack of token ids + sampling params)
    transport: TransportName = "shm"  # "shm": this ring in shared memory; "ray": the same protocol over Ray (other nodes)
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
        if self.transport not in TRANSPORT_NAMES:
            raise ValueError(f"transport must be one of {TRANSPORT_NAMES}, got {self.transport!r}")
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
