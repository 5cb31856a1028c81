"""KV page transfer between an engine cache and a ring pool (both page-major): exact, vs the reference."""

from __future__ import annotations

import pytest
import torch

from mm_serve.transport.kv_transfer import (
    copy_kv_from_ring,
    copy_kv_from_ring_ref,
    copy_kv_to_ring,
    copy_kv_to_ring_ref,
)

LAYERS, PAGE_SIZE, HEADS, HEAD_DIM = 3, 4, 2, 8


def _engine_cache(num_pages: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Random ``[num_pages, L, 2, S, H, D]`` cache."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_pages, LAYERS, 2, PAGE_SIZE, HEADS, HEAD_DIM)
    return torch.randn(shape, generator=gen).to(dtype)


def _ring_pool(num_pages: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(num_pages, LAYERS, 2, PAGE_SIZE, HEADS, HEAD_DIM, dtype=dtype)


# (engine ids on the prefill side, ring ids, engine ids on the decode side): runs on both
# sides, on one side only, on neither, single pages, descending.
ID_CASES = [
    ([5, 2, 9, 3], [0, 1, 2, 7], [1, 8, 4, 6]),
    ([4, 5, 6, 7], [8, 9, 10, 11], [0, 1, 2, 3]),
    ([11, 3, 7], [2, 3, 4], [9, 10, 0]),
    ([6, 7, 8], [11, 0, 5], [3, 4, 5]),
    ([1], [6], [10]),
    ([9, 8, 7, 6], [5, 4, 3, 2], [3, 2, 1, 0]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("prefill_ids", "ring_ids", "decode_ids"), ID_CASES)
def test_round_trip_is_exact_with_different_ids_on_each_side(
    dtype: torch.dtype, prefill_ids: list[int], ring_ids: list[int], decode_ids: list[int]
) -> None:
    prefill = _engine_cache(12, dtype)
    ring = _ring_pool(12, dtype)
    decode = torch.zeros_like(prefill)
    copy_kv_to_ring(prefill, prefill_ids, ring, ring_ids)
    copy_kv_from_ring(ring, ring_ids, decode, decode_ids)
    assert torch.equal(decode[decode_ids], prefill[prefill_ids])
    untouched = [p for p in range(12) if p not in decode_ids]
    assert torch.count_nonzero(decode[untouched]) == 0
    for ring_id, prefill_id in zip(ring_ids, prefill_ids, strict=True):
        assert torch.equal(ring[ring_id], prefill[prefill_id])


@pytest.mark.parametrize(("prefill_ids", "ring_ids", "decode_ids"), ID_CASES)
def test_fast_copies_match_the_reference(
    prefill_ids: list[int], ring_ids: list[int], decode_ids: list[int]
) -> None:
    prefill = _engine_cache(12, seed=1)
    ring, ring_ref = _ring_pool(12), _ring_pool(12)
    copy_kv_to_ring(prefill, prefill_ids, ring, ring_ids)
    copy_kv_to_ring_ref(prefill, prefill_ids, ring_ref, ring_ids)
    assert torch.equal(ring, ring_ref)
    decode, decode_ref = _engine_cache(12, seed=2), _engine_cache(12, seed=2)
    copy_kv_from_ring(ring, ring_ids, decode, decode_ids)
    copy_kv_from_ring_ref(ring, ring_ids, decode_ref, decode_ids)
    assert torch.equal(decode, decode_ref)


def test_empty_transfer_is_a_no_op() -> None:
    prefill, ring = _engine_cache(4), _ring_pool(4)
    copy_kv_to_ring(prefill, [], ring, [])
    assert torch.count_nonzero(ring) == 0


def test_bad_arguments_raise_value_error() -> None:
    prefill, ring = _engine_cache(6), _ring_pool(6)
    with pytest.raises(ValueError, match="page shapes differ"):
        copy_kv_to_ring(prefill, [0], torch.zeros(6, LAYERS, 2, PAGE_SIZE, HEADS, 4), [0])
    with pytest.raises(ValueError, match="expected kv_data"):
        copy_kv_to_ring(prefill[0], [0], ring, [0])
    with pytest.raises(ValueError, match="engine cache is torch.float32, ring is torch.bfloat16"):
        copy_kv_to_ring(prefill, [0], ring.to(torch.bfloat16), [0])
    with pytest.raises(ValueError, match="2 engine page ids but 1 ring page ids"):
        copy_kv_to_ring(prefill, [0, 1], ring, [0])
    with pytest.raises(ValueError, match=r"ring page ids out of range \[0, 6\)"):
        copy_kv_to_ring(prefill, [0], ring, [6])
    with pytest.raises(ValueError, match=r"engine page ids out of range \[0, 6\)"):
        copy_kv_from_ring(ring, [0], prefill, [-1])
    with pytest.raises(ValueError, match="destination page ids repeat"):
        copy_kv_to_ring(prefill, [0, 1], ring, [3, 3])
    with pytest.raises(ValueError, match="destination page ids repeat"):
        copy_kv_from_ring(ring, [0, 1], prefill, [2, 2])
    assert torch.count_nonzero(ring) == 0
