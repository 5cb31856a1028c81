"""The table of hand-off transports: ``RingSpec.transport`` name -> the class of its rings.

The front end hosts each pair's ring through it (:func:`host_ring`), each worker opens its
end through it (:func:`ring_opener`); nothing else chooses a class by name. A transport is
one class with the :class:`~mm_serve.transport.base.RingTransport` methods plus one entry
here (and its name in :data:`~mm_serve.transport.ring_spec.TransportName`):

* ``shm``: :class:`~mm_serve.transport.shm_ring.ShmRing`, shared memory, a pair on one node;
* ``ray``: :class:`~mm_serve.transport.ray_ring.RayRing`, Ray's object store, a pair on two.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from mm_serve.transport.base import HandoffRing, HostedRing, RingOpener, RingTransport, Side
from mm_serve.transport.ray_ring import RayRing
from mm_serve.transport.ring_spec import RingSpec
from mm_serve.transport.shm_ring import ShmRing

if TYPE_CHECKING:
    from mm_serve.transport.ray_link import RayLink

TRANSPORTS: MappingProxyType[str, RingTransport] = MappingProxyType({
    ShmRing.name: ShmRing,
    RayRing.name: RayRing,
})
"""Every transport by name; the keys are :data:`~mm_serve.transport.ring_spec.TRANSPORT_NAMES`."""


def transport_of(spec: RingSpec) -> RingTransport:
    """The class of ``spec``'s transport (every name a :class:`RingSpec` accepts is here)."""
    return TRANSPORTS[spec.transport]


def host_ring(spec: RingSpec) -> HostedRing | None:
    """What the front end creates for ring ``spec`` (:meth:`RingTransport.host`): the
    shared-memory segments, or None for a ring the two workers hold.

    Raises:
        FileExistsError: a shared-memory segment of this name exists (nothing is left behind).
    """
    return transport_of(spec).host(spec)


def ring_opener(link: RayLink | None, side: Side) -> RingOpener:
    """A function that opens ``side``'s end of a ring from its spec, of whatever transport
    the spec names; ``link`` is the worker's Ray inboxes (None in a plain worker process).

    The returned function raises as :meth:`RingTransport.open`: ``FileNotFoundError`` or
    ``ValueError`` (a shared-memory ring not there or of another spec; a Ray ring in a
    worker that is not a Ray actor).
    """

    def open_ring(spec: RingSpec) -> HandoffRing:
        return transport_of(spec).open(spec, side, link)

    return open_ring
