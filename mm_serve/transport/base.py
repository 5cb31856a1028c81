"""The one interface of a prefill -> decode hand-off transport, and of its class.

:class:`HandoffRing` is what :class:`~mm_serve.vision_prefill.handoff_sender.HandoffSender`
and :class:`~mm_serve.text_decode.handoff_receiver.HandoffReceiver` use, so the protocol
logic (allocate, copy, checksum, publish; peek, admit, claim, copy, check, release) is
written once for every transport. :class:`RingTransport` is what the class of a transport
offers the front end and the workers (:data:`mm_serve.transport.registry.TRANSPORTS` maps
each ``RingSpec.transport`` name to its class): the front end hosts a pair's ring
(:meth:`RingTransport.host`), each worker opens its end (:meth:`RingTransport.open`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol

from mm_serve.transport.ring_spec import Handoff, RingSpec

if TYPE_CHECKING:
    import torch

    from mm_serve.transport.ray_link import RayLink

Side = Literal["producer", "consumer"]
"""Which end of a ring a worker holds: the prefill worker produces, the decode worker consumes."""


class HandoffRing(Protocol):
    """A bounded, pull-based hand-off channel of one (prefill, decode) pair.

    Producer: :meth:`alloc_pages` / :meth:`alloc_features` reserve room (None when full:
    backpressure), the caller writes ``pages[ids]`` and ``features[rows]``, :meth:`publish`
    makes the hand-off visible (False when every slot is taken), :meth:`reclaim` takes back
    what the consumer released, :meth:`free_unpublished` what will not be published.
    Consumer: :meth:`peek` shows the next hand-off without taking it, :meth:`claim` takes it
    (its payload is then in ``pages[ids]`` / ``features[rows]``), :meth:`release` hands the
    room back; :meth:`discard_corrupt` takes out a hand-off that failed the transport's own
    version check (returned so that its request can be recomputed). Hand-offs are claimed in
    the order they were published (sequence numbers 0, 1, 2, ... per ring).

    Once the ring is closed (:meth:`close` is idempotent), its hand-off methods raise
    ``RuntimeError``.
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

    def alloc_pages(self, n: int) -> list[int] | None:
        """``n`` free page ids (released hand-offs reclaimed first when short), or None.

        Raises:
            ValueError: ``n`` is outside ``[0, spec.max_pages_per_handoff]``.
        """
        ...

    def alloc_features(self, rows: int) -> int | None:
        """Offset of ``rows`` contiguous free feature rows (0 for 0 rows), or None."""
        ...

    def free_unpublished(self, page_ids: list[int], feature_offset: int, feature_rows: int) -> None:
        """Give back the allocations of a hand-off that will not be published.

        Raises:
            ValueError: a page or the extent is not allocated and unpublished.
        """
        ...

    def publish(self, handoff: Handoff, timeout: float | None = 0.0) -> bool:
        """Publish ``handoff`` (its pages and features written) and set ``handoff.seq``;
        waits up to ``timeout`` seconds (None: forever) for a free slot, False if none came.

        Raises:
            ValueError: the hand-off does not fit the ring's slots, or names pages or an
                extent not allocated and unpublished here.
        """
        ...

    def reclaim(self) -> int:
        """Take back the room of hand-offs the consumer released; returns how many."""
        ...

    def peek(self) -> Handoff | None:
        """The next hand-off in order, not claimed; None when it is not there (yet)."""
        ...

    def claim(self) -> Handoff | None:
        """Take the next hand-off (its payload in this side's pages and features until
        :meth:`release`); None when there is none."""
        ...

    def release(self, handoff: Handoff) -> None:
        """Hand a claimed hand-off's room back to the producer.

        Raises:
            ValueError: ``handoff`` was not claimed here, or was released already.
        """
        ...

    def discard_corrupt(self) -> Handoff | None:
        """The next hand-off taken out (and released) by the transport's own checks; None
        when there is none."""
        ...

    def slots_used(self) -> int:
        """Hand-offs published and not yet released, as this side knows them."""
        ...

    def pages_free(self) -> int:
        """Pages of this side not held by a hand-off."""
        ...

    def check_integrity(self) -> None:
        """Check the producer's allocators; AssertionError if an invariant is broken."""
        ...

    def close(self) -> None:
        """Drop this side's views and state (idempotent)."""
        ...


class HostedRing(HandoffRing, Protocol):
    """A ring as the front end holds it while a pair runs (the shared-memory segments)."""

    def unlink(self) -> None:
        """Remove what the ring holds outside this process (idempotent)."""
        ...


class RingTransport(Protocol):
    """The class of one transport, as :data:`~mm_serve.transport.registry.TRANSPORTS` lists it."""

    @property
    def same_node(self) -> bool:
        """Whether both ends run on one node (an ``ipc://`` doorbell reaches the consumer)."""
        ...

    def host(self, spec: RingSpec) -> HostedRing | None:
        """What the front end creates for ring ``spec`` before the pair starts (it closes and
        unlinks it when the ring is replaced or the service stops); None when the two
        workers hold everything themselves."""
        ...

    def open(self, spec: RingSpec, side: Side, link: RayLink | None) -> HandoffRing:
        """Worker ``side``'s end of ring ``spec``; ``link`` is the Ray actor's inboxes (None in
        a plain worker process; a transport that needs none ignores it).

        Raises:
            FileNotFoundError, ValueError: the ring is not there (yet, or any more), was
                created from another spec, or needs a link that is missing.
        """
        ...


RingOpener = Callable[[RingSpec], HandoffRing]
"""Opens one side of a ring from its spec (:func:`~mm_serve.transport.registry.ring_opener`)."""
