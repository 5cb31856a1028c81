"""Golden tests: our runner equals transformers token for token (greedy, float32, CPU).

Cases cover text only, one and two images, image sizes and Pillow modes, prompts
from 1 to ~300 tokens, and all of them in one continuous batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from mm_serve import LLM, SamplingParams
from tests.factories import gradient_image, image_in_mode
from tests.golden import load_reference, our_first_logits, reference_generate

NEW_TOKENS = 32
LOGITS_RTOL = 1e-4
Q = "USER: <image>\nWhat is in this picture? ASSISTANT:"
Q2 = "USER: <image>\nCompare this <image>\nwith the first one. ASSISTANT:"
LONG = " ".join(["The quick brown fox jumps over the lazy dog and keeps running through the field."] * 18)


def _llava_cases() -> list[tuple[str, dict[str, Any]]]:
    cases: list[tuple[str, dict[str, Any]]] = [
        ("text-only", {"prompt": "Serving a language model means"}),
        ("one-token", {"prompt_token_ids": [7]}),
        ("one-image", {"prompt": Q, "images": [gradient_image(80, 60, 1)]}),
        ("two-images-different-sizes", {"prompt": Q2, "images": [gradient_image(200, 90, 2), gradient_image(33, 120, 3)]}),
        ("smaller-than-patch", {"prompt": Q, "images": [gradient_image(5, 3, 4)]}),
        ("strip-1xN", {"prompt": Q, "images": [gradient_image(1, 400, 5)]}),
        ("long-text-~300-tokens", {"prompt": LONG}),
        ("chat-messages", {"messages": [{"role": "user", "content": [
            {"type": "image", "image": gradient_image(64, 64, 6)}, {"type": "text", "text": "Describe the image."}]}]}),
    ]
    for mode in ("1", "L", "LA", "P", "RGBA", "CMYK", "I;16", "I", "F"):
        cases.append((f"mode-{mode}", {"prompt": Q, "images": [image_in_mode(mode, 70, 50, seed=len(cases))]}))
    return cases


LLAVA_CASES = _llava_cases()


@pytest.fixture(scope="module")
def llava_llm(tiny_llava: Path) -> LLM:
    return LLM(model=tiny_llava, mode="colocated", num_pages=256, page_size=16)


@pytest.fixture(scope="module")
def llava_reference(tiny_llava: Path) -> torch.nn.Module:
    return load_reference(tiny_llava, multimodal=True)


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _check_case(llm: LLM, reference: torch.nn.Module, request: dict[str, Any]) -> list[int]:
    inputs = llm.engine.inputs.process(request)
    expected, ref_logits = reference_generate(reference, inputs, NEW_TOKENS)
    ours = our_first_logits(llm.engine, inputs)
    rel = float((ours - ref_logits).norm() / ref_logits.norm())
    assert rel <= LOGITS_RTOL, f"first-step logits differ: relative error {rel:.2e}"
    out = llm.generate(request, _greedy())[0]
    assert out.token_ids == expected
    assert out.num_prompt_tokens == len(inputs.prompt_token_ids)
    assert out.finish_reason == "length"
    return expected


@pytest.mark.parametrize("name,request_", LLAVA_CASES, ids=[c[0] for c in LLAVA_CASES])
def test_llava_matches_transformers(llava_llm: LLM, llava_reference: torch.nn.Module, name: str, request_: dict[str, Any]) -> None:
    _check_case(llava_llm, llava_reference, request_)


def test_batch_mixing_all_cases_matches_transformers(llava_llm: LLM, llava_reference: torch.nn.Module) -> None:
    requests = [r for _, r in LLAVA_CASES]
    expected = [reference_generate(llava_reference, llava_llm.engine.inputs.process(r), NEW_TOKENS)[0] for r in requests]
    outputs = llava_llm.generate(requests, _greedy())
    assert [o.token_ids for o in outputs] == expected
    assert llava_llm.engine.kv_cache.pool.num_free == llava_llm.engine.kv_cache.pool.num_pages
    llava_llm.engine.kv_cache.pool.check_integrity()


@pytest.mark.parametrize("num_pages", [256, 48], ids=["roomy", "preempting"])
def test_mixed_steps_in_small_chunks_match_transformers(
    tiny_llava: Path, llava_reference: torch.nn.Module, num_pages: int,
) -> None:
    """Every case twice, at once, through mixed steps of 40 tokens with at most 4 running: later
    requests are prefilled in chunks (cut through prompts and images, over prefix-cache hits of
    their twin) beside the decodes of earlier ones, and each gives transformers' tokens; with 48
    pages, requests are also preempted and recomputed in chunks."""
    llm = LLM(model=tiny_llava, mode="colocated", num_pages=num_pages, page_size=16, max_running=4,
              mixed_step_tokens=40)
    scheduler = llm.engine.scheduler
    steps: list[tuple[int, int, int]] = []  # (prefill tokens, chunks short of the end, decodes) per step
    schedule = scheduler.schedule

    def recording_schedule():  # type: ignore[no-untyped-def]
        plan = schedule()
        tokens = sum((r.prefill_end or r.num_tokens) - r.num_cached_tokens for r in plan.prefill)
        steps.append((tokens, sum(1 for r in plan.prefill if not r.prefill_done), len(plan.decode)))
        return plan

    scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    requests = [r for _, r in LLAVA_CASES]
    expected = [reference_generate(llava_reference, llm.engine.inputs.process(r), NEW_TOKENS)[0] for r in requests]
    outputs = llm.generate(requests + requests, _greedy())
    assert [o.token_ids for o in outputs] == expected + expected
    assert all(tokens + decodes <= 40 for tokens, _, decodes in steps)
    assert sum(1 for tokens, _, decodes in steps if tokens and decodes) > 20  # prefill rode along with decodes
    assert sum(chunks for _, chunks, _ in steps) > 10
    assert (scheduler.num_preemptions > 0) == (num_pages == 48)
    assert llm.engine.prefix.hit_tokens > 0 or num_pages == 48  # twins hit unless the small pool evicted them
    assert llm.engine.kv_cache.pool.num_free == num_pages and scheduler.prefilling == []
    llm.engine.kv_cache.pool.check_integrity()


def test_image_tokens_counted_in_prompt(llava_llm: LLM) -> None:
    out = llava_llm.generate({"prompt": Q2, "images": [gradient_image(40, 40), gradient_image(50, 30)]}, _greedy())[0]
    text_only = llava_llm.engine.inputs.tokenizer(Q2).input_ids
    assert out.num_prompt_tokens == len(text_only) - 2 + 2 * 16


def test_multilayer_full_strategy_tied_matches_transformers(tiny_llava_multilayer: Path) -> None:
    llm = LLM(model=tiny_llava_multilayer, mode="colocated", num_pages=128)
    reference = load_reference(tiny_llava_multilayer, multimodal=True)
    assert llm.engine.model_config.vision is not None
    assert llm.engine.model_config.vision.num_image_tokens == 17  # 16 patches + CLS
    for request in ({"prompt": Q, "images": [gradient_image(90, 45, 8)]}, {"prompt": "A picture of"}):
        _check_case(llm, reference, request)


@pytest.mark.parametrize("prompt_ids", [[5], list(range(5, 25)), [(i * 37) % 500 + 5 for i in range(290)]], ids=["1", "20", "290"])
def test_text_only_llama_matches_transformers(tiny_llama: Path, prompt_ids: list[int]) -> None:
    llm = LLM(model=tiny_llama, mode="colocated", num_pages=128)
    reference = load_reference(tiny_llama, multimodal=False)
    _check_case(llm, reference, {"prompt_token_ids": prompt_ids})


def test_perturbed_weight_is_detected(tiny_llava: Path, llava_reference: torch.nn.Module) -> None:
    """The parity check is sensitive: one perturbed weight breaks it."""
    llm = LLM(model=tiny_llava, mode="colocated", num_pages=64)
    request = {"prompt": Q, "images": [gradient_image(80, 60, 1)]}
    inputs = llm.engine.inputs.process(request)
    expected, ref_logits = reference_generate(llava_reference, inputs, NEW_TOKENS)
    with torch.no_grad():
        llm.engine.model.language_model.layers[1].mlp.down_proj.weight[3, 7] += 0.5
    ours = our_first_logits(llm.engine, inputs)
    assert float((ours - ref_logits).norm() / ref_logits.norm()) > LOGITS_RTOL


def test_rejects_image_count_mismatch(llava_llm: LLM) -> None:
    from mm_serve.inputs.input_processor import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="1 image placeholder"):
        llava_llm.generate({"prompt": Q, "images": []}, _greedy())
    with pytest.raises(InvalidRequestError, match="context length"):
        llava_llm.generate({"prompt": "hi"}, SamplingParams(max_tokens=10**6))
    assert isinstance(Image.new("RGB", (2, 2)), Image.Image)


def test_torch_gemm_and_attention_path_matches_transformers(
    tiny_llava: Path, llava_reference: torch.nn.Module,
) -> None:
    """``cpu_gemm="torch"`` (F.linear, no packed weights) and ``cpu_kernels="torch"`` (gather +
    SDPA, not the compiled kernel) give the reference's tokens too."""
    from mm_serve.kernels.cpu_linear import PackedLinear
    from mm_serve.kernels.paged_attention_ref import TorchRefAttention

    llm = LLM(model=tiny_llava, mode="colocated", num_pages=256, cpu_gemm="torch", cpu_kernels="torch")
    assert not any(isinstance(m, PackedLinear) for m in llm.engine.model.modules())
    assert type(llm.engine.model.language_model.backend) is TorchRefAttention
    requests = [r for name, r in LLAVA_CASES if name in ("text-only", "one-image", "two-images-different-sizes", "long-text-~300-tokens")]
    expected = [reference_generate(llava_reference, llm.engine.inputs.process(r), NEW_TOKENS)[0] for r in requests]
    assert [o.token_ids for o in llm.generate(requests, _greedy())] == expected
