"""Decode side of the hand-off: claim ready hand-offs when there is KV room, copy them in, release.

Pull-based, as in DistServe: a hand-off stays in its ring until this worker has
the pages and a running slot for it; the copy into the local paged cache is done
before the ring pages are released back to the prefill worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kernels.kv_transfer import copy_kv_from_ring
from kernels.ring_buffer import CrossModalRing
from mm_serve import messages
from mm_serve.engine.request import Request
from mm_serve.engine.sampling_wire import from_wire
from text_decode.kv_cache import PagedKVCache, pages_for


def restore_generator(state: bytes | None) -> torch.Generator | None:
    """A CPU generator continuing from a serialised state (None for greedy requests)."""
    if state is None:
        return None
    generator = torch.Generator(device="cpu")
    generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return generator


class HandoffReceiver:
    """Claims from every ring (round-robin start) into ``kv_cache``."""

    def __init__(self, rings: list[CrossModalRing], kv_cache: PagedKVCache) -> None:
        self.rings = rings
        self.kv_cache = kv_cache
        self._start = 0

    def claim_ready(
        self, can_admit: Callable[[int], bool], aborted: set[str]
    ) -> list[tuple[Request, torch.Generator | None, dict[str, float]]]:
        """Claim every hand-off that fits now; returns (request, generator, events) per claim.

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
                claimed.append(self._adopt(ring, handoff))
        self._start = (self._start + 1) % max(n, 1)
        return claimed

    def _adopt(self, ring: CrossModalRing, handoff) -> tuple[Request, torch.Generator | None, dict[str, float]]:  # type: ignore[no-untyped-def]
        meta = messages.decode_meta(handoff.meta)
        pages = self.kv_cache.pool.allocate(len(handoff.page_ids))
        copy_kv_from_ring(ring.pages, handoff.page_ids, self.kv_cache.data, pages)
        embeds = None
        if handoff.feature_rows:
            rows = ring.features[handoff.feature_offset : handoff.feature_offset + handoff.feature_rows]
            embeds = rows.to(self.kv_cache.data.device, copy=True)
        ring.release(handoff)
        request = Request(
            request_id=handoff.request_id, prompt_token_ids=list(meta.prompt_token_ids),
            sampling_params=from_wire(meta.sampling), num_images=meta.num_images, image_embeds=embeds,
            output_token_ids=[handoff.first_token], block_table=pages,
        )
        if meta.first_logprobs is not None:
            request.output_logprobs.append(meta.first_logprobs)
        events = dict(meta.events)
        events["handoff_end"] = time.time()
        return request, restore_generator(meta.generator_state), events
