"""One interface, two transports for the prefill -> decode hand-off.

:class:`HandoffRing` is what :class:`~mm_serve.vision_prefill.handoff_sender.HandoffSender` and
:class:`~mm_serve.text_decode.handoff_receiver.HandoffReceiver` use, so the protocol logic
(allocate, copy, checksum, publish; peek, admit, claim, copy, check, release) is written
once. Two classes have it:

* :class:`mm_serve.transport.ring_buffer.CrossModalRing`: a shared-memory segment, for a pair on one
  node (``RingSpec.transport == "shm"``);
* :class:`mm_serve.transport.ray_ring.RayRing`: the same protocol between two Ray actors on
  different nodes, the KV pages and features moving through Ray's object store
  (``RingSpec.transport == "ray"``).

:func:`ring_opener` picks the class from the spec.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from mm_serve.transport.ring_buffer import CrossModalRing, Handoff
from mm_serve.transport.ring_spec import RingSpec

if TYPE_CHECKING:
    from mm_serve.transport.ray_link import RayLink

Side = Literal["producer", "consumer"]


class HandoffRing(Protocol):
    """A bounded, pull-based hand-off channel of one (prefill, decode) pair.

    Producer: :meth:`alloc_pages` / :meth:`alloc_features` reserve room (None when full:
    backpressure), the caller writes ``pages[ids]`` and ``features[rows]``, :meth:`publish`
    makes the hand-off visible (False when every slot is taken), :meth:`reclaim` takes back
    what the consumer released, :meth:`free_unpublished` what will not be published.
    Consumer: :meth:`peek` shows the next hand-off without taking it, :meth:`claim` takes it
    (its payload is then in ``pages[ids]`` / ``features[rows]``), :meth:`release` hands the
    room back; :meth:`discard_corrupt` takes out a hand-off that failed the transport's own
    version check (returned so that its request can be recomputed).
    """

    spec: RingSpec

    @property
    def pages(self) -> torch.Tensor:
        """``[num_pages, *page_shape]`` pages of this side (shared, staged or landed)."""
        ...

    @property
    def features(self) -> torch.Tensor:
        """``[feature_rows, feature_dim]`` feature rows of this side."""
        ...

    def alloc_pages(self, n: int) -> list[int] | None: ...

    def alloc_features(self, rows: int) -> int | None: ...

    def free_unpublished(self, page_ids: list[int], feature_offset: int, feature_rows: int) -> None: ...

    def publish(self, handoff: Handoff, timeout: float | None = 0.0) -> bool: ...

    def reclaim(self) -> int: ...

    def peek(self) -> Handoff | None: ...

    def claim(self) -> Handoff | None: ...

    def release(self, handoff: Handoff) -> None: ...

    def discard_corrupt(self) -> Handoff | None: ...

    def slots_used(self) -> int: ...

    def pages_free(self) -> int: ...

    def close(self) -> None: ...


RingOpener = Callable[[RingSpec], HandoffRing]


def ring_opener(link: RayLink | None, side: Side) -> RingOpener:
    """A function that opens a ring of ``side`` from its spec: attaches the shared-memory
    segment (``transport == "shm"``) or joins the Ray transport through ``link``.

    The returned function raises ``FileNotFoundError`` / ``ValueError`` as
    :meth:`CrossModalRing.attach`, and ``ValueError`` for a Ray ring in a worker that is
    not a Ray actor (``link`` None).
    """

    def open_ring(spec: RingSpec) -> HandoffRing:
        if spec.transport == "shm":
            return CrossModalRing.attach(spec)
        if link is None:
            raise ValueError(f"ring {spec.name!r} runs over Ray, but this worker is not a Ray actor")
        from mm_serve.transport.ray_ring import RayRing

        return RayRing(spec, link, side)

    return open_ring
