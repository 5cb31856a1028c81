"""Decode side of the hand-off: claim ready hand-offs when there is KV room, copy them in, release.

Pull-based, as in DistServe: a hand-off stays in its ring until this worker has
the pages and a running slot for it; the copy into the local paged cache is done
before the ring pages are released back to the prefill worker.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from mm_serve.runtime import messages
from mm_serve.runtime.kv_cache import PagedKVCache, pages_for
from mm_serve.runtime.lifetime import LifetimeEvent, events_from_wire
from mm_serve.runtime.request import Request
from mm_serve.runtime.sampler import make_generator
from mm_serve.runtime.sampling_wire import from_wire
from mm_serve.transport.base import HandoffRing, RingOpener
from mm_serve.transport.handoff_checksum import handoff_checksum
from mm_serve.transport.kv_transfer import copy_kv_from_ring
from mm_serve.transport.registry import ring_opener
from mm_serve.transport.ring_spec import Handoff, RingSpec


class BadHandoff(Exception):
    """A claimed hand-off failed its checks; nothing was adopted from it."""


class HandoffReceiver:
    """Claims from every ring (round-robin start) into ``kv_cache``.

    Hand-offs that fail a check (a READY slot at the wrong lap, meta that does not
    parse or names another request, a payload checksum that does not match) are
    released without running and reported to ``on_failed(request_id, reason)``; the
    front end prefills those requests again.
    """

    def __init__(
        self, rings: list[HandoffRing], kv_cache: PagedKVCache,
        on_failed: Callable[[str, str], None] | None = None, open_ring: RingOpener | None = None,
    ) -> None:
        """``rings[p]`` joins prefill worker ``p`` (shared memory or Ray:
        :mod:`mm_serve.transport.base`); ``open_ring`` opens the ring of a restarted
        prefill worker (:meth:`replace_ring`; default: the consumer's end of a ring of a plain
        worker process, :func:`~mm_serve.transport.registry.ring_opener`)."""
        self.rings = rings
        self.kv_cache = kv_cache
        self._on_failed = on_failed
        self._open_ring = open_ring or ring_opener(None, "consumer")
        self._start = 0

    def replace_ring(self, prefill_index: int, spec: RingSpec) -> None:
        """Prefill worker ``prefill_index`` was restarted with a fresh ring: close the old one
        (what it still held is dropped; the front end resubmits those requests), attach ``spec``.

        Raises:
            FileNotFoundError, ValueError: as :meth:`RingTransport.open <mm_serve.transport.base.RingTransport.open>`.
        """
        self.rings[prefill_index].close()
        self.rings[prefill_index] = self._open_ring(spec)

    def _fail(self, request_id: str, reason: str) -> None:
        if self._on_failed is not None:
            self._on_failed(request_id, reason)

    def claim_ready(
        self, can_admit: Callable[[int], bool], aborted: set[str],
        on_claim: Callable[[Request], None] | None = None,
        make_room: Callable[[int, int], object] | None = None,
    ) -> list[Request]:
        """Claim every hand-off that fits now; returns one running-ready request per claim
        (KV in its ``block_table``, first token as its one output, marked reported).

        ``can_admit(num_pages)`` is asked before each claim, for the pages of the prompt
        plus the first token (allocated with the claim, so the first decode step needs no
        more); ``on_claim(request)`` runs right after each claim, before the next question,
        so a scheduler that adds the request there counts it (``max_running`` holds exactly).

        When ``can_admit`` says no, ``make_room(num_pages, priority)`` (if given) may preempt
        running requests of a lower tier than the hand-off's (``priority`` from its meta) so
        that it fits; ``can_admit`` is then asked again.

        Hand-offs of requests in ``aborted`` are claimed and released without running
        (their ids are removed from the set).
        """
        claimed = []
        n = len(self.rings)
        for k in range(n):
            ring = self.rings[(self._start + k) % n]
            while True:
                head = ring.peek()
                if head is None:
                    bad = ring.discard_corrupt()
                    if bad is None:
                        break
                    self._fail(bad.request_id, f"hand-off seq {bad.seq} failed the ring's version check")
                    continue
                if head.request_id in aborted:
                    handoff = ring.claim()
                    if handoff is not None:
                        ring.release(handoff)
                    aborted.discard(head.request_id)
                    continue
                need = pages_for(head.num_kv_tokens + 1, self.kv_cache.page_size)
                if not can_admit(need) and not (
                        make_room is not None and make_room(need, _priority(head.meta)) and can_admit(need)):
                    break
                handoff = ring.claim()
                if handoff is None:
                    break
                try:
                    request = self._adopt(ring, handoff)
                except BadHandoff as exc:
                    self._fail(handoff.request_id, str(exc))
                    continue
                claimed.append(request)
                if on_claim is not None:
                    on_claim(request)
        self._start = (self._start + 1) % max(n, 1)
        return claimed

    def _adopt(self, ring: HandoffRing, handoff: Handoff) -> Request:
        """Copy a claimed hand-off into the local cache and release it; raise :class:`BadHandoff`
        (after releasing it and freeing the local pages) when a check fails."""
        pages: list[int] = []
        try:
            try:
                meta = messages.decode_meta(handoff.meta)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise BadHandoff(f"hand-off meta does not parse: {exc}") from None
            if meta.request_id != handoff.request_id or len(meta.prompt_token_ids) != handoff.num_kv_tokens:
                raise BadHandoff(f"hand-off meta belongs to {meta.request_id!r} ({len(meta.prompt_token_ids)} "
                                 f"tokens), the slot to {handoff.request_id!r} ({handoff.num_kv_tokens})")
            # room for the first decoded token too: what can_admit was asked for
            pages = self.kv_cache.pool.allocate(pages_for(handoff.num_kv_tokens + 1, self.kv_cache.page_size))
            copy_kv_from_ring(ring.pages, handoff.page_ids, self.kv_cache.data, pages[: len(handoff.page_ids)])
            embeds = None
            if handoff.feature_rows:
                rows = ring.features[handoff.feature_offset : handoff.feature_offset + handoff.feature_rows]
                embeds = rows.to(self.kv_cache.data.device, copy=True)
            if meta.checksum is not None:  # over the ring memory, after the copy: a change in between shows
                crc = handoff_checksum(ring.pages, handoff.page_ids, ring.features, handoff.feature_offset,
                                       handoff.feature_rows)
                if crc != meta.checksum:
                    raise BadHandoff(f"hand-off payload checksum {crc:#010x} != {meta.checksum:#010x}")
        except BadHandoff:
            self.kv_cache.pool.free(pages)
            ring.release(handoff)
            raise
        ring.release(handoff)
        seed = meta.seed
        request = Request(
            request_id=handoff.request_id, prompt_token_ids=list(meta.prompt_token_ids),
            sampling_params=from_wire(meta.sampling), num_images=meta.num_images, image_embeds=embeds,
            image_token_counts=list(meta.image_token_counts),
            image_sizes=[tuple(int(v) for v in size) for size in meta.image_sizes],
            image_second_per_grid=list(meta.image_second_per_grid),
            block_table=pages, generator=None if seed is None else make_generator(seed), seed=seed,
            output_offset=meta.output_offset, events=events_from_wire(meta.events), priority=meta.priority,
        )
        request.append_output(handoff.first_token, meta.first_logprobs)
        request.num_sent_tokens = 1  # the prefill worker reported the first token
        request.stamp(LifetimeEvent.HANDOFF_END)
        return request


def _priority(meta: bytes) -> int:
    """The SLO tier rank in a hand-off's meta (1, standard, when it does not parse: the claim
    checks it properly)."""
    try:
        return messages.decode_meta(meta).priority
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 1
