"""Decode side of the hand-off: claim ready hand-offs when there is KV room, copy them in, release.

Pull-based, as in DistServe: a hand-off stays in its ring until this worker has
the pages and a running slot for it; the copy into the local paged cache is done
before the ring pages are released back to the prefill worker.
"""

from __future__ import annotations

from collections.abc import Callable

from kernels.kv_transfer import copy_kv_from_ring
from kernels.ring_buffer import CrossModalRing, Handoff
from mm_serve.runtime import messages
from mm_serve.runtime.kv_cache import PagedKVCache, pages_for
from mm_serve.runtime.lifetime import LifetimeEvent, events_from_wire
from mm_serve.runtime.request import Request
from mm_serve.runtime.sampler import restore_generator
from mm_serve.runtime.sampling_wire import from_wire


class HandoffReceiver:
    """Claims from every ring (round-robin start) into ``kv_cache``."""

    def __init__(self, rings: list[CrossModalRing], kv_cache: PagedKVCache) -> None:
        self.rings = rings
        self.kv_cache = kv_cache
        self._start = 0

    def claim_ready(
        self, can_admit: Callable[[int], bool], aborted: set[str],
        on_claim: Callable[[Request], None] | None = None,
    ) -> list[Request]:
        """Claim every hand-off that fits now; returns one running-ready request per claim
        (KV in its ``block_table``, first token as its one output, marked reported).

        ``can_admit(num_pages)`` is asked before each claim, for the pages of the prompt
        plus the first token (allocated with the claim, so the first decode step needs no
        more); ``on_claim(request)`` runs right after each claim, before the next question,
        so a scheduler that adds the request there counts it (``max_running`` holds exactly).

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
                    break
                if head.request_id in aborted:
                    handoff = ring.claim()
                    if handoff is not None:
                        ring.release(handoff)
                    aborted.discard(head.request_id)
                    continue
                if not can_admit(pages_for(head.num_kv_tokens + 1, self.kv_cache.page_size)):
                    break
                handoff = ring.claim()
                if handoff is None:
                    break
                request = self._adopt(ring, handoff)
                claimed.append(request)
                if on_claim is not None:
                    on_claim(request)
        self._start = (self._start + 1) % max(n, 1)
        return claimed

    def _adopt(self, ring: CrossModalRing, handoff: Handoff) -> Request:
        meta = messages.decode_meta(handoff.meta)
        # room for the first decoded token too: what can_admit was asked for
        pages = self.kv_cache.pool.allocate(pages_for(handoff.num_kv_tokens + 1, self.kv_cache.page_size))
        copy_kv_from_ring(ring.pages, handoff.page_ids, self.kv_cache.data, pages[: len(handoff.page_ids)])
        embeds = None
        if handoff.feature_rows:
            rows = ring.features[handoff.feature_offset : handoff.feature_offset + handoff.feature_rows]
            embeds = rows.to(self.kv_cache.data.device, copy=True)
        ring.release(handoff)
        request = Request(
            request_id=handoff.request_id, prompt_token_ids=list(meta.prompt_token_ids),
            sampling_params=from_wire(meta.sampling), num_images=meta.num_images, image_embeds=embeds,
            block_table=pages, generator=restore_generator(meta.generator_state),
            events=events_from_wire(meta.events),
        )
        request.append_output(handoff.first_token, meta.first_logprobs)
        request.num_sent_tokens = 1  # the prefill worker reported the first token
        request.stamp(LifetimeEvent.HANDOFF_END)
        return request
