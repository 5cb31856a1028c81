"""Prefill over a cached prefix (prefix caching, chunked prefill) equals causal attention over the
whole sequence: the new queries see the cached keys plus their own, never a later one."""

from __future__ import annotations

import random

import torch

from mm_serve.kernels.attention_metadata import AttentionMetadata
from mm_serve.kernels.paged_attention_ref import (
    TorchRefAttention,
    prefill_attention_ref,
    write_kv_ref,
)

PAGE, HKV, HQ, D = 4, 2, 4, 8


def test_new_tokens_after_a_cached_prefix_match_full_causal_attention() -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    data = torch.zeros(64, 3, 2, PAGE, HKV, D)
    k_cache, v_cache = data[:, 1, 0], data[:, 1, 1]  # a strided layer view, as PagedKVCache hands out
    free = list(range(64))
    rng.shuffle(free)
    sequences = [(0, 9), (8, 5), (12, 1), (3, 14)]  # (cached tokens, new tokens); 3 is mid-page
    tables, queries, keys, values, expected = [], [], [], [], []
    for cached, new in sequences:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // PAGE))]
        q, k, v = torch.randn(total, HQ, D), torch.randn(total, HKV, D), torch.randn(total, HKV, D)
        slots = torch.tensor([table[p // PAGE] * PAGE + p % PAGE for p in range(cached)], dtype=torch.long)
        write_kv_ref(k[:cached], v[:cached], k_cache, v_cache, slots)  # the prefix is already cached
        expected.append(prefill_attention_ref(q, k, v, [total], 0.3)[cached:])
        tables.append(table)
        queries.append(q[cached:])
        keys.append(k[cached:])
        values.append(v[cached:])
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        is_prefill=True, seq_lens=[n for _, n in sequences], prefix_lens=[c for c, _ in sequences],
        slot_mapping=torch.tensor([t[p // PAGE] * PAGE + p % PAGE for t, (c, n) in zip(tables, sequences, strict=True)
                                   for p in range(c, c + n)], dtype=torch.long),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long),
    )
    assert meta.has_prefix
    out = TorchRefAttention().forward(torch.cat(queries), torch.cat(keys), torch.cat(values), k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(out, torch.cat(expected), rtol=1e-5, atol=1e-5)


def test_a_pass_without_prefixes_keeps_the_plain_path() -> None:
    meta = AttentionMetadata(is_prefill=True, seq_lens=[3], prefix_lens=[0], slot_mapping=torch.arange(3))
    assert not meta.has_prefix
