"""The same engine on a CUDA device: parity with transformers on that device, hand-off through a host ring.

Skipped where CUDA is absent (the CPU CI); run on a GPU machine with
``python -m pytest tests/test_cuda.py``. Decode steps replay CUDA graphs there (checked against the eager path). The workers' KV caches live on the GPU
while the cross-modal ring stays in host shared memory, so the disaggregated case
checks the cross-device page copies of :mod:`mm_serve.transport.kv_transfer` and the
hand-off of image features.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mm_serve import LLM, SamplingParams
from mm_serve.config import config_from_dict
from mm_serve.kernels.backend_select import select_attention_backend
from mm_serve.transport.kv_transfer import copy_kv_from_ring, copy_kv_to_ring
from tests.golden import load_reference, our_first_logits, reference_generate
from tests.test_golden_parity import LLAVA_CASES, LOGITS_RTOL, NEW_TOKENS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CASES = [c for c in LLAVA_CASES if c[0] in (
    "text-only", "one-image", "two-images-different-sizes", "long-text-~300-tokens", "chat-messages", "mode-RGBA",
)]


@pytest.fixture(scope="module")
def cuda_reference(tiny_llava: Path) -> torch.nn.Module:
    return load_reference(tiny_llava, multimodal=True).to("cuda")


@pytest.fixture(scope="module")
def cuda_llm(tiny_llava: Path) -> LLM:
    return LLM(model=tiny_llava, mode="colocated", num_pages=256, page_size=16, device="cuda")


@pytest.fixture(scope="module")
def expected(cuda_llm: LLM, cuda_reference: torch.nn.Module) -> dict[str, list[int]]:
    """transformers' greedy ids per case, on the GPU."""
    out = {}
    for name, request in CASES:
        inputs = cuda_llm.engine.inputs.process(request)
        out[name] = reference_generate(cuda_reference, inputs, NEW_TOKENS)[0]
    return out


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_kv_pages_copy_between_cuda_cache_and_host_ring() -> None:
    shape = (6, 2, 2, 4, 2, 8)  # [pages, layers, K/V, page_size, kv_heads, head_dim]
    cache = torch.randn(shape, device="cuda")
    ring = torch.zeros(shape)
    copy_kv_to_ring(cache, [4, 1, 2], ring, [0, 1, 2])  # non-consecutive source run: gathered on the GPU
    copy_kv_to_ring(cache, [3, 4], ring, [4, 5])  # consecutive run: one copy
    assert torch.equal(ring[[0, 1, 2, 4, 5]], cache[[4, 1, 2, 3, 4]].cpu())
    back = torch.zeros(shape, device="cuda")
    copy_kv_from_ring(ring, [5, 0, 1], back, [2, 3, 4])
    assert torch.equal(back[[2, 3, 4]].cpu(), ring[[5, 0, 1]])
    assert back[[0, 1, 5]].abs().sum().item() == 0.0


def test_backend_on_cuda_is_a_real_backend() -> None:
    backend = select_attention_backend(torch.device("cuda"))
    import importlib.util

    expected = "FlashAttention" if importlib.util.find_spec("flash_attn") else "TorchRefAttention"
    assert type(backend).__name__ == expected


@pytest.mark.parametrize("name,request_", CASES, ids=[c[0] for c in CASES])
def test_colocated_on_cuda_matches_transformers_on_cuda(
    cuda_llm: LLM, cuda_reference: torch.nn.Module, expected: dict[str, list[int]], name: str, request_: dict,
) -> None:
    inputs = cuda_llm.engine.inputs.process(request_)
    _, ref_logits = reference_generate(cuda_reference, inputs, 1)
    ours = our_first_logits(cuda_llm.engine, inputs)
    assert ours.device.type == "cuda"
    rel = float((ours - ref_logits).norm() / ref_logits.norm())
    assert rel <= LOGITS_RTOL, f"first-step logits differ: relative error {rel:.2e}"
    assert cuda_llm.generate(request_, _greedy())[0].token_ids == expected[name]


def test_batch_on_cuda_matches_transformers(cuda_llm: LLM, expected: dict[str, list[int]]) -> None:
    outs = cuda_llm.generate([r for _, r in CASES], _greedy())
    assert [o.token_ids for o in outs] == [expected[n] for n, _ in CASES]


def test_decode_steps_replay_cuda_graphs_and_equal_eager(tiny_llava: Path, cuda_llm: LLM) -> None:
    graphs = cuda_llm.engine.runner.graphs
    assert graphs is not None
    requests = [r for _, r in CASES]
    sampled = SamplingParams(max_tokens=24, temperature=0.9, top_k=20, seed=5, ignore_eos=True)
    with_graphs = [o.token_ids for o in cuda_llm.generate(requests, sampled)]
    assert graphs.num_graphs >= 1
    eager = LLM(model=tiny_llava, mode="colocated", num_pages=256, page_size=16, device="cuda", enforce_eager=True)
    assert eager.engine.runner.graphs is None
    assert [o.token_ids for o in eager.generate(requests, sampled)] == with_graphs
    assert eager.engine.runner.graphs is None and cuda_llm.engine.kv_cache.pool.num_used == 0


def test_disaggregated_on_cuda_matches_transformers_and_colocated_sampling(
    tiny_llava: Path, cuda_llm: LLM, expected: dict[str, list[int]],
) -> None:
    config = config_from_dict({}, {
        "compute.prefill_gpus": [0], "compute.decode_gpus": [0], "kv_cache.max_pages_per_gpu": 256,
        "kv_cache.page_size": 16,
    })
    sampled = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    with LLM(model=tiny_llava, config=config) as llm:
        outs = llm.generate([r for _, r in CASES], _greedy())
        assert [o.token_ids for o in outs] == [expected[n] for n, _ in CASES]
        disagg_sampled = llm.generate(CASES[1][1], sampled)[0].token_ids
    assert disagg_sampled == cuda_llm.generate(CASES[1][1], sampled)[0].token_ids


def test_flex_on_cuda_matches_transformers_with_cuda_graphs(tiny_llava: Path, expected: dict[str, list[int]]) -> None:
    """FlexAttention compiled on the GPU, decode steps in CUDA graphs: transformers' greedy ids, alone and batched."""
    from mm_serve.kernels.flex_paged_attention import FlexPagedAttention

    llm = LLM(model=tiny_llava, mode="colocated", num_pages=256, page_size=16, device="cuda", attention_backend="flex")
    backend = llm.engine.model.language_model.backend
    assert type(backend) is FlexPagedAttention and backend.compiled
    assert llm.engine.runner.graphs is not None
    requests = [r for _, r in CASES]
    for (name, _), out in zip(CASES, llm.generate(requests, _greedy()), strict=True):
        assert out.token_ids == expected[name], name


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_on_cuda_matches_transformers(tiny_llava: Path, dtype: str) -> None:
    """bf16/fp16 weights, KV pages and features on the GPU: transformers' greedy ids in the same dtype, case by case."""
    reference = load_reference(tiny_llava, multimodal=True).to("cuda", getattr(torch, dtype))
    llm = LLM(model=tiny_llava, mode="colocated", num_pages=256, page_size=16, device="cuda", dtype=dtype)
    assert llm.engine.kv_cache.data.dtype == getattr(torch, dtype)
    for name, request in CASES:
        want, _ = reference_generate(reference, llm.engine.inputs.process(request), NEW_TOKENS)
        assert llm.generate(request, _greedy())[0].token_ids == want, name
