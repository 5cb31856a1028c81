"""FlexAttention over the paged cache equals the torch reference on random paged layouts.

Layouts are drawn at random: ragged context lengths (1 token to several pages, partial last pages),
pages shared by several sequences (a prefix-cache hit), pages in random order, GQA, page sizes 16
and 32, in the page-major multi-layer cache the engine uses (a layer's pages are strided). Eager
FlexAttention here; one test compiles it (``torch.compile``, the path a GPU runs) on the CPU.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from mm_serve import LLM, SamplingParams
from mm_serve.kernels.attention_metadata import AttentionMetadata
from mm_serve.kernels.flex_paged_attention import (
    CacheGeometry,
    FlexPagedAttention,
    decode_block_mask,
    logical_index,
)
from mm_serve.kernels.paged_attention_ref import TorchRefAttention
from mm_serve.runtime.kv_cache import PagedKVCache

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
SCALE = HEAD_DIM ** -0.5
ATOL = 2e-6  # float32: the two compute the same sums in another order


def _cache(page_size: int, num_pages: int = 96, layers: int = 3) -> PagedKVCache:
    cache = PagedKVCache(layers, num_pages, page_size, KV_HEADS, HEAD_DIM)
    cache.data.normal_()  # every page holds finite values, as after earlier requests
    return cache


def _tables(rng: random.Random, totals: list[int], page_size: int, num_pages: int, shared: int,
            sharers: list[int] | None = None) -> list[list[int]]:
    """Block tables for sequences of ``totals`` tokens; the ``sharers`` (default: the even ones) start
    with the same ``shared`` pages (never their last), as after a prefix-cache hit."""
    free = list(range(num_pages))
    rng.shuffle(free)
    common = [free.pop() for _ in range(shared)]
    tables = []
    for i, total in enumerate(totals):
        need = -(-total // page_size)
        sharing = i % 2 == 0 if sharers is None else i in sharers
        head = common[: min(need - 1, shared)] if sharing else []
        tables.append(head + [free.pop() for _ in range(need - len(head))])
    return tables


def _padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables])


def _slots(tables: list[list[int]], starts: list[int], ends: list[int], page_size: int) -> torch.Tensor:
    return torch.tensor([t[p // page_size] * page_size + p % page_size
                         for t, a, b in zip(tables, starts, ends, strict=True) for p in range(a, b)])


def _both(meta_of, q, k, v, cache: PagedKVCache, layer: int, backend: FlexPagedAttention) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The reference's and FlexAttention's outputs for the same pass (each writes the same new K/V)."""
    k_cache, v_cache = cache.layer_caches[layer]
    expected = TorchRefAttention().forward(q, k, v, k_cache, v_cache, meta_of(), SCALE)
    return expected, backend.forward(q, k, v, k_cache, v_cache, meta_of(), SCALE)


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("seed", range(3))
def test_decode_equals_reference_on_random_layouts(page_size: int, seed: int) -> None:
    rng = random.Random(seed)
    cache = _cache(page_size)
    contexts = [1, page_size, page_size + 1] + [rng.randint(1, 5 * page_size) for _ in range(5)]
    tables = _tables(rng, contexts, page_size, cache.num_pages, shared=2)
    batch = len(contexts)
    q = torch.randn(batch, HEADS, HEAD_DIM)
    k, v = torch.randn(batch, KV_HEADS, HEAD_DIM), torch.randn(batch, KV_HEADS, HEAD_DIM)

    def meta() -> AttentionMetadata:
        return AttentionMetadata(
            is_prefill=False, seq_lens=[1] * batch, slot_mapping=_slots(tables, [c - 1 for c in contexts], contexts, page_size),
            block_tables=_padded(tables), context_lens=torch.tensor(contexts))

    expected, got = _both(meta, q, k, v, cache, seed % 3, FlexPagedAttention())
    assert got.shape == (batch, HEADS, HEAD_DIM)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("seed", range(3))
def test_prefill_over_cached_prefixes_equals_reference(page_size: int, seed: int) -> None:
    """A batch mixing sequences with no prefix, page-aligned prefixes, prefixes ending inside a page
    (a chunk boundary), and prefixes shared with other sequences."""
    rng = random.Random(100 + seed)
    cache = _cache(page_size)
    new = [rng.randint(1, 150) for _ in range(6)]
    prefixes = [0, page_size, 2 * page_size, 5, 0, 3 * page_size + 7]
    totals = [p + n for p, n in zip(prefixes, new, strict=True)]
    # the shared page lies inside the cached prefix of each sequence holding it (pass K/V never go there)
    tables = _tables(rng, totals, page_size, cache.num_pages, shared=1, sharers=[1, 2, 5])
    tokens = sum(new)
    q = torch.randn(tokens, HEADS, HEAD_DIM)
    k, v = torch.randn(tokens, KV_HEADS, HEAD_DIM), torch.randn(tokens, KV_HEADS, HEAD_DIM)

    def meta() -> AttentionMetadata:
        return AttentionMetadata(is_prefill=True, seq_lens=new, slot_mapping=_slots(tables, prefixes, totals, page_size),
                                 block_tables=_padded(tables), prefix_lens=prefixes)

    expected, got = _both(meta, q, k, v, cache, 1, FlexPagedAttention())
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", [16, 32])
def test_batched_varlen_prefill_equals_per_sequence_prefill(page_size: int) -> None:
    """One FlexAttention call for a whole prefill batch of ragged lengths equals one pass per sequence."""
    rng = random.Random(7)
    lengths = [1, 17, page_size, 130, 64, 3, 200]
    cache = _cache(page_size)
    tables = _tables(rng, lengths, page_size, cache.num_pages, shared=0)
    tokens = sum(lengths)
    q = torch.randn(tokens, HEADS, HEAD_DIM)
    k, v = torch.randn(tokens, KV_HEADS, HEAD_DIM), torch.randn(tokens, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = cache.layer_caches[0]
    backend = FlexPagedAttention()
    calls = []
    attend = backend._attend
    backend._attend = lambda *a, **kw: calls.append(a[0].shape) or attend(*a, **kw)  # type: ignore[method-assign]
    meta = AttentionMetadata(is_prefill=True, seq_lens=lengths, slot_mapping=_slots(tables, [0] * 7, lengths, page_size))
    batched = backend.forward(q, k, v, k_cache, v_cache, meta, SCALE)
    assert calls == [torch.Size([1, HEADS, tokens, HEAD_DIM])]  # one call for the batch
    start = 0
    for i, n in enumerate(lengths):
        one = AttentionMetadata(is_prefill=True, seq_lens=[n], slot_mapping=_slots(tables[i:i + 1], [0], [n], page_size))
        alone = backend.forward(q[start:start + n], k[start:start + n], v[start:start + n], k_cache, v_cache, one, SCALE)
        torch.testing.assert_close(batched[start:start + n], alone, atol=ATOL, rtol=0)
        start += n


def test_decode_block_mask_lists_each_rows_pages() -> None:
    """Full pages are listed as full (no mask_mod), a partial last page as partial, nothing else."""
    cache = _cache(16, num_pages=10, layers=2)
    geometry = CacheGeometry.of(cache.layer_caches[1][0])
    assert (geometry.row_stride, geometry.blocks_per_page) == (2 * 2 * 16, 4)
    tables = torch.tensor([[3, 7, 1], [5, 0, 0]])
    mask = decode_block_mask(tables, torch.tensor([40, 16]), geometry)
    assert mask.full_kv_num_blocks.flatten().tolist() == [2, 1]
    assert mask.full_kv_indices[0, 0, 0, :2].tolist() == [3 * 4, 7 * 4]
    assert mask.full_kv_indices[1, 0, 0, :1].tolist() == [5 * 4]
    assert mask.kv_num_blocks.flatten().tolist() == [1, 0]
    assert mask.kv_indices[0, 0, 0, 0].item() == 1 * 4
    assert logical_index(tables, torch.tensor([40, 16]), 10, 16).tolist() == [
        [-1, 2, -1, 0, -1, -1, -1, 1, -1, -1], [-1, -1, -1, -1, -1, 0, -1, -1, -1, -1]]


def test_cache_geometry_refuses_a_cache_it_cannot_view() -> None:
    with pytest.raises(ValueError, match="contiguous pages"):
        CacheGeometry.of(torch.zeros(4, 16, 2, 8).transpose(1, 2))


@pytest.fixture
def inductor_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile's files go to ``tmp_path``, and no precompiled headers (inductor puts those in
    its default folder under /tmp whatever it is told)."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(inductor_config, "cpp_cache_precompile_headers", False)


@pytest.mark.usefixtures("inductor_in_tmp")
def test_compiled_flex_equals_reference() -> None:
    """``torch.compile(flex_attention)`` (the kernel a GPU runs) on the CPU: decode and prefill. A
    fused kernel visits only the listed pages, so it catches block-list errors eager FlexAttention
    cannot see (a page shared by two sequences of one query block was once listed twice)."""
    rng = random.Random(3)
    cache = _cache(16, num_pages=32, layers=2)
    backend = FlexPagedAttention(compiled=True, dynamic=False)
    contexts = [5, 16, 33, 70]
    tables = _tables(rng, contexts, 16, cache.num_pages, shared=1, sharers=[1, 2])

    def decode() -> AttentionMetadata:
        return AttentionMetadata(is_prefill=False, seq_lens=[1] * 4, slot_mapping=_slots(tables, [c - 1 for c in contexts], contexts, 16),
                                 block_tables=_padded(tables), context_lens=torch.tensor(contexts))

    q, k, v = torch.randn(4, HEADS, HEAD_DIM), torch.randn(4, KV_HEADS, HEAD_DIM), torch.randn(4, KV_HEADS, HEAD_DIM)
    expected, got = _both(decode, q, k, v, cache, 1, backend)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    prefixes, new = [0, 16, 20, 0], [5, 17, 13, 70]
    totals = [p + n for p, n in zip(prefixes, new, strict=True)]
    tables = _tables(rng, totals, 16, cache.num_pages, shared=1, sharers=[1, 2])

    def prefill() -> AttentionMetadata:
        return AttentionMetadata(is_prefill=True, seq_lens=new, slot_mapping=_slots(tables, prefixes, totals, 16),
                                 block_tables=_padded(tables), prefix_lens=prefixes)

    tokens = sum(new)
    q, k, v = torch.randn(tokens, HEADS, HEAD_DIM), torch.randn(tokens, KV_HEADS, HEAD_DIM), torch.randn(tokens, KV_HEADS, HEAD_DIM)
    expected, got = _both(prefill, q, k, v, cache, 0, backend)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_flex_is_close_to_reference(dtype: torch.dtype) -> None:
    rng = random.Random(11)
    cache = PagedKVCache(2, 64, 16, KV_HEADS, HEAD_DIM, dtype=dtype)
    cache.data.normal_()
    contexts = [3, 40, 77]
    tables = _tables(rng, contexts, 16, 64, shared=1)
    q = torch.randn(3, HEADS, HEAD_DIM, dtype=dtype)
    k, v = torch.randn(3, KV_HEADS, HEAD_DIM, dtype=dtype), torch.randn(3, KV_HEADS, HEAD_DIM, dtype=dtype)

    def meta() -> AttentionMetadata:
        return AttentionMetadata(is_prefill=False, seq_lens=[1] * 3, slot_mapping=_slots(tables, [c - 1 for c in contexts], contexts, 16),
                                 block_tables=_padded(tables), context_lens=torch.tensor(contexts))

    expected, got = _both(meta, q, k, v, cache, 1, FlexPagedAttention())
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=0)


def test_golden_cases_with_flex_match_transformers(tiny_llava: Path) -> None:
    """The whole engine on FlexAttention (``attention_backend="flex"``): every golden case alone and
    all of them in one continuous batch give transformers' greedy tokens (float32)."""
    from tests.golden import load_reference, our_first_logits, reference_generate
    from tests.test_golden_parity import LLAVA_CASES, LOGITS_RTOL

    # eager FlexAttention scores every page of the cache: a small one keeps this quick
    llm = LLM(model=tiny_llava, mode="colocated", num_pages=128, page_size=16, attention_backend="flex")
    assert llm.engine is not None
    assert type(llm.engine.model.language_model.backend) is FlexPagedAttention
    reference = load_reference(tiny_llava, multimodal=True)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    requests = [r for _, r in LLAVA_CASES]
    expected = []
    for request in requests:
        inputs = llm.engine.inputs.process(request)
        tokens, ref_logits = reference_generate(reference, inputs, 24)
        ours = our_first_logits(llm.engine, inputs)
        assert float((ours - ref_logits).norm() / ref_logits.norm()) <= LOGITS_RTOL
        expected.append(tokens)
    for _ in range(2):  # the second round reads its prefixes from the cache
        assert [o.token_ids for o in llm.generate(requests, greedy)] == expected
    assert llm.engine.prefix.hit_tokens > 0
    pool = llm.engine.kv_cache.pool
    assert pool.num_free == pool.num_pages


def test_chunked_disaggregated_prefill_on_flex_matches_transformers(tiny_llava: Path) -> None:
    """The prefill worker on FlexAttention prefills a ~330-token prompt with two images in chunks of 24
    tokens (each chunk attends to the earlier ones through the cached pages, chunk ends inside pages
    and inside images), hands it to a decode worker on FlexAttention: transformers' greedy tokens."""
    from tests.factories import gradient_image
    from tests.golden import load_reference, reference_generate
    from tests.test_golden_parity import LONG, Q2

    reference = load_reference(tiny_llava, multimodal=True)
    request = {"prompt": LONG + " " + Q2, "images": [gradient_image(200, 90, 2), gradient_image(33, 120, 3)]}
    with LLM(model=tiny_llava, mode="disaggregated", num_pages=96, attention_backend="flex",
             prefill_chunk_tokens=24) as llm:
        assert llm.client is not None
        inputs = llm.client.inputs.process(request)
        assert len(inputs.prompt_token_ids) > 300
        expected, _ = reference_generate(reference, inputs, 16)
        out = llm.generate(request, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
        assert out.token_ids == expected
