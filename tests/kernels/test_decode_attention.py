"""Decode attention over a page-major cache: per-sequence exactness and length grouping."""

from __future__ import annotations

import random

import torch
from hypothesis import given
from hypothesis import strategies as st

from mm_serve.kernels.paged_attention_ref import (
    MIN_SPLIT_CONTEXT,
    decode_attention_ref,
    length_groups,
    write_kv_ref,
)

LAYERS, PAGE, HKV, HQ, D = 3, 4, 2, 4, 8


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query ``[Hq, D]`` over ``k``/``v`` ``[L, Hkv, D]`` with explicit softmax (float64)."""
    group = q.shape[0] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    weights = torch.softmax(torch.einsum("hd,lhd->hl", q.double(), k) * scale, dim=-1)
    return torch.einsum("hl,lhd->hd", weights, v).float()


def test_mixed_lengths_match_a_dense_reference_per_sequence() -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    lens = [1, 5, 16, 17, 40, 300, 7, 150]
    data = torch.zeros(200, LAYERS, 2, PAGE, HKV, D)  # page-major, like PagedKVCache
    k_cache, v_cache = data[:, 1, 0], data[:, 1, 1]  # a strided layer view
    free = list(range(200))
    rng.shuffle(free)
    tables, keys, values = [], [], []
    for n in lens:
        table = [free.pop() for _ in range(-(-n // PAGE))]
        slots = torch.tensor([table[t // PAGE] * PAGE + t % PAGE for t in range(n)])
        k, v = torch.randn(n, HKV, D), torch.randn(n, HKV, D)
        write_kv_ref(k, v, k_cache, v_cache, slots)
        tables.append(table)
        keys.append(k)
        values.append(v)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    query = torch.randn(len(lens), HQ, D)
    out = decode_attention_ref(query, k_cache, v_cache, block_tables, torch.tensor(lens), D**-0.5)
    for i, n in enumerate(lens):
        expected = _dense(query[i], keys[i], values[i], D**-0.5)
        assert torch.allclose(out[i], expected, atol=1e-5), f"row {i} (context {n})"
    assert torch.count_nonzero(data[:, [0, 2]]) == 0  # other layers untouched


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=64))
def test_length_groups_partition_the_batch_with_bounded_padding(lens: list[int]) -> None:
    groups = length_groups(lens)
    assert sorted(row for g in groups for row in g) == list(range(len(lens)))
    for g in groups:
        longest = lens[g[0]]
        assert all(lens[r] <= longest for r in g)
        if longest >= MIN_SPLIT_CONTEXT:  # long groups pad no row past twice its context
            assert all(2 * lens[r] >= longest for r in g)
    longest = [lens[g[0]] for g in groups]
    assert longest == sorted(longest, reverse=True)
    assert len(groups) <= 1 + (max(lens) // MIN_SPLIT_CONTEXT).bit_length()
    # rows shorter than MIN_SPLIT_CONTEXT never start a group of their own once it is reached
    assert sum(1 for n in longest if n < MIN_SPLIT_CONTEXT) <= 1


def test_short_contexts_share_one_call_and_long_ones_split() -> None:
    assert length_groups([40, 200, 120, 33]) == [[1, 2, 0, 3]]
    assert length_groups([2000, 300, 1500, 900, 40]) == [[0, 2], [3], [1], [4]]
