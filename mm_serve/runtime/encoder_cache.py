"""Encoder cache: image content hash -> projected patch embeddings, LRU by bytes.

A repeated image (a follow-up question about the same picture, the same product photo in
many requests) skips the vision tower and the projector. Keys are the content hashes of
the preprocessed pixels (:func:`mm_serve.runtime.page_hashes.image_content_hash`), so only
identical tower inputs share an entry. vLLM, SGLang and Dynamo keep such a cache; here it
lives in each prefill (or colocated) worker.

A request copies nothing: it holds a reference to its images' embeddings
(``Request.image_embeds`` is built from them) for its whole life, preemption included, so
evicting an entry never takes features away from a running or preempted request; it only
drops the cache's own reference.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    """At most ``capacity_bytes`` of embeddings ``[image tokens, hidden]``, one per image hash.

    Counters since start: ``hits``, ``misses`` (images looked up), ``evictions`` (entries dropped
    for room). ``capacity_bytes`` 0 disables the cache (every lookup misses, nothing is kept).
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"encoder cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # least recently used first
        self.bytes_used = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: bytes) -> torch.Tensor | None:
        """The embeddings of the image with content hash ``digest`` (now most recently used), or None."""
        entry = self._entries.get(digest)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(digest)
        return entry

    def put(self, digest: bytes, embeds: torch.Tensor) -> bool:
        """Keep ``embeds`` under ``digest``, evicting least recently used entries for room;
        returns False (keeping nothing) when it is larger than the whole capacity."""
        size = embeds.numel() * embeds.element_size()
        if size > self.capacity_bytes or digest in self._entries:
            return False
        while self.bytes_used + size > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes_used -= old.numel() * old.element_size()
            self.evictions += 1
        self._entries[digest] = embeds
        self.bytes_used += size
        return True
