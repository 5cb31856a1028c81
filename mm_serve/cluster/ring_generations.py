"""Every pair's hand-off ring over the service's life: the current specs, the rings the front
end hosts, fresh rings for a restarted worker, and old rings kept for a peer still loading.

Rings are ordered prefill-major: ring ``p * M + d`` joins prefill worker ``p`` and decode
worker ``d`` (``M`` decode workers). A restarted worker gets a fresh ring for each of its
pairs (a new name, ``<base>-r<generation>``): the front end hosts it through the table of
transports (:func:`~mm_serve.transport.registry.host_ring`; shared memory, or nothing for a
ring over Ray) and each peer is told to switch (:class:`~mm_serve.runtime.messages.ReplaceRing`).
An old hosted ring is unlinked at once, unless its peer is still loading and may attach it
from its start-up spec: then it is kept until that peer is ready (and has been told to
switch) or has failed (:meth:`RingGenerations.release`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from mm_serve.cluster.worker_state import WorkerKey
from mm_serve.ground.roles import Role
from mm_serve.runtime import messages
from mm_serve.transport.base import HostedRing
from mm_serve.transport.registry import host_ring
from mm_serve.transport.ring_spec import RingSpec

_GENERATION_SUFFIX = re.compile(r"-r\d+$")

Respec = Callable[[RingSpec, int, int], RingSpec]
"""A fresh spec of pair (p, d) made fit for where its workers run now (Ray: the actors' names)."""


@dataclass(frozen=True)
class RingSwap:
    """A peer of a restarted worker and what it is told: switch its ring there to a fresh one."""

    peer: WorkerKey
    message: messages.ReplaceRing


class RingGenerations:
    """The rings of the N x M (prefill, decode) pairs of one service instance."""

    def __init__(self, specs: list[RingSpec], num_decode: int) -> None:
        """Host every ring of ``specs`` (prefill-major).

        Raises:
            FileExistsError: a shared-memory segment of a ring's name exists.
        """
        self.specs = list(specs)
        self._num_decode = num_decode
        self._generation = 0
        self._hosted: dict[int, HostedRing] = {}
        for i, spec in enumerate(self.specs):
            hosted = host_ring(spec)
            if hosted is not None:
                self._hosted[i] = hosted
        self._retired: list[tuple[HostedRing, set[WorkerKey]]] = []  # old rings a loading peer may attach

    @property
    def rings(self) -> list[HostedRing]:
        """The rings the front end hosts: the shared-memory rings (every pair's on one machine;
        with Ray, those of pairs on the front end's node), in pair order."""
        return [self._hosted[i] for i in sorted(self._hosted)]

    def transports(self) -> list[str]:
        """Each pair's transport name (``shm`` or ``ray``), prefill-major."""
        return [spec.transport for spec in self.specs]

    def renew(self, key: WorkerKey, respec: Respec, peer_loading: Callable[[WorkerKey], bool],
              ) -> tuple[list[RingSpec], list[RingSwap]]:
        """Fresh rings for every pair of worker ``key`` (a prefill or decode worker), hosted here.

        Returns the worker's rings in its own order (decode order for a prefill worker,
        prefill order for a decode worker) and, per ring, the swap its peer is to be told.
        Each old hosted ring is closed, and unlinked unless ``peer_loading(peer)``: then it is
        kept until :meth:`release` of that peer.

        Raises:
            FileExistsError: a fresh shared-memory segment's name exists.
        """
        role, index = key
        m = self._num_decode
        prefill = role == Role.PREFILL
        pairs = [index * m + d for d in range(m)] if prefill else [p * m + index for p in range(len(self.specs) // m)]
        self._generation += 1
        rings, swaps = [], []
        for ring_index in pairs:
            p, d = divmod(ring_index, m)
            base = _GENERATION_SUFFIX.sub("", self.specs[ring_index].name)
            spec = respec(msgspec.structs.replace(self.specs[ring_index], name=f"{base}-r{self._generation}"), p, d)
            self.specs[ring_index] = spec
            old = self._hosted.pop(ring_index, None)
            hosted = host_ring(spec)
            if hosted is not None:
                self._hosted[ring_index] = hosted
            rings.append(spec)
            peer, peer_index = ((Role.DECODE, d), p) if prefill else ((Role.PREFILL, p), d)
            if old is not None:
                old.close()
                if peer_loading(peer):
                    self._retired.append((old, {peer}))
                else:
                    old.unlink()
            swaps.append(RingSwap(peer, messages.ReplaceRing(peer_index, spec)))
        return rings, swaps

    def release(self, key: WorkerKey) -> None:
        """Worker ``key`` no longer needs the old rings it may have attached (it is ready, or
        failed): unlink those no other worker waits on."""
        kept = []
        for ring, waiting in self._retired:
            waiting.discard(key)
            if waiting:
                kept.append((ring, waiting))
            else:
                ring.unlink()
        self._retired = kept

    def close(self) -> None:
        """Close and unlink every hosted ring and unlink every retired one (idempotent)."""
        for ring in self.rings:
            ring.close()
            ring.unlink()
        for ring, _ in self._retired:
            ring.unlink()
        self._retired = []
