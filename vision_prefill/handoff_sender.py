"""Prefill side of the hand-off: copy a prefilled request's KV pages and features into a ring, publish.

A request whose ring is full (no pages, no feature room, or no free slot) stays
pending here with its KV in the prefill worker's own cache; it is retried every
loop iteration. That is the backpressure of the design: prefill waits, its
queue grows, nothing is dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mm_serve.runtime import messages
from mm_serve.runtime.kv_cache import PagedKVCache
from mm_serve.runtime.lifetime import LifetimeEvent, events_to_wire
from mm_serve.runtime.request import Request
from mm_serve.runtime.sampling_wire import to_wire
from mm_serve.transport.base import HandoffRing, RingOpener
from mm_serve.transport.handoff_checksum import handoff_checksum
from mm_serve.transport.kv_transfer import copy_kv_to_ring
from mm_serve.transport.registry import ring_opener
from mm_serve.transport.ring_spec import Handoff, RingSpec


@dataclass
class PendingHandoff:
    """A prefilled request waiting to be published to decode worker ``decode_index``."""

    request: Request
    decode_index: int
    meta: messages.HandoffMeta
    ring_pages: list[int] | None = None
    feature_offset: int = 0
    copied: bool = False
    meta_bytes: bytes = b""  # encoded once the pages are in the ring (it carries their checksum)


class HandoffSender:
    """Owns the pending list; one ring per decode worker (``rings[d]``), each a shared-memory
    ring or a Ray one (:mod:`mm_serve.transport.base`): the logic is the same."""

    def __init__(
        self, rings: list[HandoffRing], kv_cache: PagedKVCache,
        on_publish: Callable[[int], None] | None = None, checksum: bool = True,
        release: Callable[[Request], None] | None = None,
        open_ring: RingOpener | None = None,
    ) -> None:
        """``on_publish(d)`` runs after each publish to decode worker ``d``'s ring
        (the prefill worker rings that worker's doorbell); with ``checksum`` each hand-off's
        meta carries the CRC-32 of its ring pages and features (:mod:`mm_serve.transport.handoff_checksum`);
        ``release(request)`` frees a request's local pages and empties its block table
        (default: straight back to the pool; the prefill worker's keeps cached pages cached);
        ``open_ring`` opens the ring of a restarted decode worker (:meth:`replace_ring`; default:
        the producer's end of a ring of a plain worker process, :func:`~mm_serve.transport.registry.ring_opener`)."""
        self.rings = rings
        self.kv_cache = kv_cache
        self._release = release or self._free_pages
        self.pending: list[PendingHandoff] = []
        self.failed: list[tuple[Request, str]] = []  # hand-offs that can never be published, and why (the caller
        # reports them and clears the list)
        self._on_publish = on_publish
        self._checksum = checksum
        self._open_ring = open_ring or ring_opener(None, "producer")

    def add(self, request: Request) -> None:
        """Queue a prefilled request (first token sampled, KV in its ``block_table``) for
        ``request.decode_index``'s ring."""
        request.stamp(LifetimeEvent.HANDOFF_BEGIN)
        p = request.sampling_params
        meta = messages.HandoffMeta(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            sampling=to_wire(p, frozenset()), seed=request.seed if request.generator is not None else None,
            output_offset=request.output_offset, num_images=request.num_images,
            image_token_counts=list(request.image_token_counts),
            image_sizes=list(request.image_sizes), image_second_per_grid=list(request.image_second_per_grid),
            first_logprobs=request.output_logprobs[0] if request.output_logprobs else None,
            events=events_to_wire(request.events), priority=request.priority,
        )
        self.pending.append(PendingHandoff(request, request.decode_index, meta))

    def pump(self) -> list[Request]:
        """Reclaim released slots, then try to publish every pending hand-off in order.

        Returns the requests published now (their local pages are freed here).
        """
        for ring in self.rings:
            ring.reclaim()
        published: list[Request] = []
        still: list[PendingHandoff] = []
        for item in self.pending:
            try:
                sent = self._try_publish(item)
            except ValueError as exc:  # does not fit the ring's slots: this request fails, not the worker
                self._drop(item)
                self.failed.append((item.request, f"its hand-off does not fit the ring: {exc}"))
                continue
            if sent:
                if self._on_publish is not None:
                    self._on_publish(item.decode_index)
                published.append(item.request)
                self._release(item.request)
            else:
                still.append(item)
        self.pending = still
        return published

    def _try_publish(self, item: PendingHandoff) -> bool:
        ring = self.rings[item.decode_index]
        request = item.request
        rows = 0 if request.image_embeds is None else int(request.image_embeds.shape[0])
        if item.ring_pages is None:
            pages = ring.alloc_pages(len(request.block_table))
            if pages is None:
                return False
            offset = ring.alloc_features(rows) if rows else 0
            if offset is None:
                ring.free_unpublished(pages, 0, 0)
                return False
            item.ring_pages, item.feature_offset = pages, offset
        if not item.copied:
            copy_kv_to_ring(self.kv_cache.data, request.block_table, ring.pages, item.ring_pages)
            if rows and request.image_embeds is not None:
                ring.features[item.feature_offset : item.feature_offset + rows].copy_(
                    request.image_embeds.to(ring.features.dtype)
                )
            item.copied = True
            if self._checksum:
                item.meta.checksum = handoff_checksum(
                    ring.pages, item.ring_pages, ring.features, item.feature_offset, rows)
            item.meta_bytes = messages.encode_meta(item.meta)
        handoff = Handoff(
            request_id=request.request_id, page_ids=item.ring_pages, num_kv_tokens=request.num_prompt_tokens,
            first_token=request.output_token_ids[0], feature_offset=item.feature_offset, feature_rows=rows,
            meta=item.meta_bytes,
        )
        return ring.publish(handoff, timeout=0.0)

    def abort(self, request_id: str) -> Request | None:
        """Drop a pending hand-off: free its local pages and any ring allocation."""
        for item in self.pending:
            if item.request.request_id == request_id:
                self.pending.remove(item)
                self._drop(item)
                return item.request
        return None

    def _drop(self, item: PendingHandoff) -> None:
        """Free a hand-off's ring allocation (when it has one) and its local pages."""
        if item.ring_pages is not None:
            rows = 0 if item.request.image_embeds is None else int(item.request.image_embeds.shape[0])
            self.rings[item.decode_index].free_unpublished(item.ring_pages, item.feature_offset, rows)
        self._release(item.request)

    def replace_ring(self, decode_index: int, spec: RingSpec) -> list[str]:
        """Decode worker ``decode_index`` was restarted with a fresh ring: drop every pending
        hand-off to it (their local pages are freed; the front end resubmits those
        requests), close the old ring and attach ``spec``. Returns the dropped request ids.

        Raises:
            FileNotFoundError, ValueError: as :meth:`RingTransport.open <mm_serve.transport.base.RingTransport.open>`.
        """
        dropped = [item for item in self.pending if item.decode_index == decode_index]
        self.pending = [item for item in self.pending if item.decode_index != decode_index]
        for item in dropped:
            self._release(item.request)
        self.rings[decode_index].close()
        self.rings[decode_index] = self._open_ring(spec)
        return [item.request.request_id for item in dropped]

    def _free_pages(self, request: Request) -> None:
        self.kv_cache.pool.free(request.block_table)
        request.block_table = []

    @property
    def num_pending(self) -> int:
        return len(self.pending)

    def slots_used(self) -> int:
        return sum(ring.slots_used() for ring in self.rings)

