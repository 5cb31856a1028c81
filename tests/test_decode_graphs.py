"""The padded, graph-safe decode step (what a CUDA graph captures), run eagerly on the CPU.

Capture itself needs CUDA (tests/test_cuda.py); here the same padded step must give
the same logits and tokens as the ordinary decode path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mm_serve import LLM, SamplingParams
from mm_serve.kernels.paged_attention_ref import decode_attention_padded, decode_attention_ref
from mm_serve.runtime.decode_graphs import DecodeGraphs, batch_bucket, pages_bucket
from tests.factories import build_checkpoint, gradient_image

Q = "USER: <image>\nWhat is in this picture? ASSISTANT:"


def test_buckets() -> None:
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 9, 17, 33, 65, 512)] == [1, 2, 4, 8, 16, 24, 48, 96, 512]
    assert batch_bucket(513) is None
    assert [pages_bucket(p) for p in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 16]


def test_padded_attention_equals_grouped_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    pages, size, kv_heads, heads, dim = 40, 4, 2, 6, 8
    k_cache = torch.randn(pages, size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(pages, size, kv_heads, dim, generator=gen)
    lens = [1, 4, 5, 17, 30, 3]  # contexts of 1 to 8 pages
    width = 8
    order = torch.randperm(pages - 1, generator=gen).tolist()
    tables = []
    for n in lens:
        need = -(-n // size)
        row, order = order[:need], order[need:]
        tables.append(row + [pages - 1] * (width - need))  # padding entries on a spare page
    query = torch.randn(len(lens), heads, dim, generator=gen)
    block_tables = torch.tensor(tables)
    context = torch.tensor(lens)
    expected = decode_attention_ref(query, k_cache, v_cache, block_tables, context, 0.35)
    got = decode_attention_padded(query, k_cache, v_cache, block_tables, context, 0.35)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_capture_needs_cuda(tiny_llava: Path) -> None:
    llm = LLM(model=tiny_llava, mode="colocated", num_pages=64)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA KV cache"):
        DecodeGraphs(llm.engine.runner.forward_decode, llm.engine.kv_cache, 8, capture=True)
    assert llm.engine.runner.graphs is None  # never on a CPU


@pytest.mark.parametrize("max_batch", [64, 2], ids=["all-padded", "larger-batches-uncaptured"])
def test_padded_step_generates_the_same_tokens(tiny_llava: Path, max_batch: int) -> None:
    _padded_equals_plain(tiny_llava, max_batch)


def test_padded_step_on_a_qwen2_decoder(tmp_path: Path) -> None:
    """Qwen2's q/k/v biases through the padded step (LLaVA-OneVision's and FastVLM's decoder)."""
    _padded_equals_plain(build_checkpoint("llava-qwen2", tmp_path / "llava-qwen2"), 64)


def test_padded_step_on_m_rope(tmp_path: Path) -> None:
    """Qwen2-VL's decode steps turn each request's tokens at its index plus its M-RoPE delta: the padded
    step (what CUDA graphs capture) feeds the same rotary positions as the plain one, whose tokens equal
    transformers' (tests/test_qwen2_vl.py)."""
    _padded_equals_plain(build_checkpoint("qwen2-vl", tmp_path / "qwen2-vl"), 64)


def _padded_equals_plain(tiny_llava: Path, max_batch: int) -> None:
    requests = [
        {"prompt": "Serving a language model means"},
        {"prompt_token_ids": [7]},
        {"prompt": Q, "images": [gradient_image(80, 60, 1)]},
        {"prompt": " ".join(["a long prompt"] * 40)},
        {"prompt": Q, "images": [gradient_image(30, 90, 2)]},
    ]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=24, temperature=0.9, top_k=20, seed=3, ignore_eos=True)
    plain = LLM(model=tiny_llava, mode="colocated", num_pages=256, page_size=4)
    padded = LLM(model=tiny_llava, mode="colocated", num_pages=256, page_size=4)
    graphs = DecodeGraphs(padded.engine.runner.forward_decode, padded.engine.kv_cache, max_batch, capture=False)
    padded.engine.runner.graphs = graphs
    batches: list[int] = []
    run = graphs.run
    graphs.run = lambda reqs: (batches.append(len(reqs)), run(reqs))[1]  # type: ignore[method-assign]
    for params in (greedy, sampled):
        want = [o.token_ids for o in plain.generate(requests, params)]
        got = [o.token_ids for o in padded.generate(requests, params)]
        assert got == want
        assert len(set(map(tuple, got))) == len(requests)  # the cases really differ
    assert (max(batches) == len(requests)) if max_batch >= len(requests) else not batches
    assert padded.engine.kv_cache.pool.num_used == 0 and padded.engine.kv_cache.pool.integrity_ok()
