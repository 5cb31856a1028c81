"""The encoder cache: LRU by bytes, capacity, counters."""

from __future__ import annotations

import pytest
import torch

from mm_serve.runtime.encoder_cache import EncoderCache


def _embeds(rows: int, value: float) -> torch.Tensor:
    return torch.full((rows, 4), value)  # rows * 16 bytes


def test_lru_by_bytes_evicts_the_least_recently_used_entry() -> None:
    cache = EncoderCache(capacity_bytes=3 * 32)
    for key in (b"a", b"b", b"c"):
        assert cache.put(key, _embeds(2, 1.0))
    assert cache.bytes_used == 96 and len(cache) == 3
    assert cache.get(b"a") is not None  # a is now the most recent
    assert cache.put(b"d", _embeds(2, 2.0))
    assert cache.get(b"b") is None and cache.get(b"a") is not None and cache.get(b"d") is not None
    assert (cache.hits, cache.misses, cache.evictions) == (3, 1, 1)
    assert cache.bytes_used == 96


def test_an_entry_larger_than_the_cache_is_not_kept_and_evicts_nothing() -> None:
    cache = EncoderCache(capacity_bytes=64)
    assert cache.put(b"a", _embeds(2, 1.0))
    assert not cache.put(b"huge", _embeds(8, 1.0))
    assert len(cache) == 1 and cache.evictions == 0 and cache.get(b"huge") is None


def test_zero_capacity_keeps_nothing_and_negative_is_refused() -> None:
    assert not EncoderCache(0).put(b"a", _embeds(1, 1.0))
    with pytest.raises(ValueError, match=">= 0"):
        EncoderCache(-1)


def test_an_evicted_entry_stays_valid_for_a_request_that_holds_it() -> None:
    cache = EncoderCache(capacity_bytes=32)
    kept = _embeds(2, 3.0)
    cache.put(b"a", kept)
    held = cache.get(b"a")  # a running request's image_embeds
    cache.put(b"b", _embeds(2, 4.0))  # evicts a
    assert cache.get(b"a") is None
    assert held is not None and torch.equal(held, torch.full((2, 4), 3.0))
