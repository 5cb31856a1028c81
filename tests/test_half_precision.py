"""bfloat16 and float16 end to end on the CPU: greedy tokens equal transformers' in the same dtype.

The reference is transformers' own model class loaded in that dtype (``dtype=``), so both sides
round the same weights; they still add in different orders (our fused QKV and gate/up
projections, our paged attention), so first-step logits agree to ~1e-2, not 1e-4, and
the check that matters is the greedy tokens, which must be equal on every golden case.

Each case runs alone, as transformers runs it. In a continuous batch the same request's tokens can
differ in bf16/fp16, and so they would in transformers' own padded batches: the CPU kernels block
their sums by the batch's shapes (SDPA over a padded decode group, batched prefill and vision
passes), and a sum rounded to 8 bits in another order flips a near tie of this random model's
logits. float32 is exact in batches too (tests/test_golden_parity.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from mm_serve import LLM, SamplingParams
from tests.golden import our_first_logits, reference_generate
from tests.test_golden_parity import LLAVA_CASES, Q2, Q

NEW_TOKENS = 24
HALF_LOGITS_RTOL = 3e-2  # relative L2 of first-step logits: both sides round every product to 8 (bf16) or 11 (fp16) bits
DTYPES = ("bfloat16", "float16")


def _reference(model_dir: Path, dtype: str, multimodal: bool = True) -> torch.nn.Module:
    from transformers import LlamaForCausalLM, LlavaForConditionalGeneration

    cls = LlavaForConditionalGeneration if multimodal else LlamaForCausalLM
    return cls.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()


def _greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=DTYPES)
def half(request: pytest.FixtureRequest, tiny_llava: Path) -> tuple[str, LLM, torch.nn.Module]:
    dtype = request.param
    llm = LLM(model=tiny_llava, mode="colocated", num_pages=256, page_size=16, dtype=dtype)
    return dtype, llm, _reference(tiny_llava, dtype)


@pytest.mark.parametrize("name,request_", LLAVA_CASES, ids=[c[0] for c in LLAVA_CASES])
def test_golden_cases_match_transformers_in_half_precision(
    half: tuple[str, LLM, torch.nn.Module], name: str, request_: dict[str, Any],
) -> None:
    dtype, llm, reference = half
    assert llm.engine is not None
    assert llm.engine.kv_cache.data.dtype == getattr(torch, dtype)
    assert next(llm.engine.model.parameters()).dtype == getattr(torch, dtype)
    inputs = llm.engine.inputs.process(request_)
    expected, ref_logits = reference_generate(reference, inputs, NEW_TOKENS)
    ours = our_first_logits(llm.engine, inputs)
    assert ours.dtype == torch.float32  # the sampler works in float32 whatever the model's dtype
    rel = float((ours - ref_logits).norm() / ref_logits.norm())
    assert rel <= HALF_LOGITS_RTOL, f"{dtype} first-step logits differ: relative error {rel:.2e}"
    out = llm.generate(request_, _greedy())[0]
    assert out.token_ids == expected


@pytest.mark.parametrize("dtype", DTYPES)
def test_text_only_llama_in_half_precision(tiny_llama: Path, dtype: str) -> None:
    llm = LLM(model=tiny_llama, mode="colocated", num_pages=128, dtype=dtype)
    reference = _reference(tiny_llama, dtype, multimodal=False)
    for ids in ([5], list(range(5, 25)), [(i * 37) % 500 + 5 for i in range(290)]):
        request = {"prompt_token_ids": ids}
        expected, _ = reference_generate(reference, llm.engine.inputs.process(request), NEW_TOKENS)
        assert llm.generate(request, _greedy())[0].token_ids == expected


def test_disaggregated_bfloat16_equals_transformers(tiny_llava: Path) -> None:
    """Prefill and decode workers in bfloat16: KV pages and image features cross the ring in
    bfloat16 (half the bytes of float32), and the tokens are transformers' in bfloat16."""
    reference = _reference(tiny_llava, "bfloat16")
    from tests.factories import gradient_image

    requests = [{"prompt": Q, "images": [gradient_image(80, 60, 1)]}, {"prompt": "Serving a language model means"},
                {"prompt": Q2, "images": [gradient_image(200, 90, 2), gradient_image(33, 120, 3)]}]
    with LLM(model=tiny_llava, mode="disaggregated", num_pages=256, dtype="bfloat16") as llm:
        assert llm.client is not None
        assert llm.client.config.dtype == "bfloat16"
        for request in requests:  # one at a time, as the reference runs (module docstring)
            expected, _ = reference_generate(reference, llm.client.inputs.process(request), NEW_TOKENS)
            assert llm.generate(request, _greedy())[0].token_ids == expected


def _with_declared_dtype(src: Path, dst: Path, dtype: str | None) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for section in (cfg, cfg.get("text_config", {})):
        section.pop("dtype", None)
        section.pop("torch_dtype", None)
    if dtype is not None:
        cfg["torch_dtype"] = dtype  # the older key: auto reads both
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("declared", ["bfloat16", "float16", None])
def test_dtype_auto_on_a_cpu_is_float32(tiny_llama: Path, tmp_path: Path, declared: str | None) -> None:
    """auto takes the checkpoint's type on a GPU only: on a CPU the fast kernels are float32."""
    model_dir = _with_declared_dtype(tiny_llama, tmp_path / "ckpt", declared)
    llm = LLM(model=model_dir, mode="colocated", num_pages=64, dtype="auto")
    assert llm.engine is not None
    assert llm.engine.config.dtype == "float32"
    assert llm.engine.kv_cache.data.dtype == torch.float32
    assert next(llm.engine.model.parameters()).dtype == torch.float32
    assert len(llm.generate({"prompt_token_ids": [5, 6, 7]}, _greedy(4))[0].token_ids) == 4


@pytest.mark.parametrize("declared,served", [("bfloat16", "bfloat16"), ("float16", "float16"), (None, "float32")])
def test_dtype_auto_on_a_gpu_takes_the_checkpoints(tiny_llama: Path, tmp_path: Path, declared: str | None,
                                                   served: str) -> None:
    from mm_serve.models.registry import load_model_config
    from mm_serve.runtime.engine_config import EngineConfig

    raw = load_model_config(_with_declared_dtype(tiny_llama, tmp_path / "ckpt", declared)).raw
    assert EngineConfig(device="cuda:0").for_checkpoint(raw).dtype == served
    assert EngineConfig(device="cpu").for_checkpoint(raw).dtype == "float32"
    assert EngineConfig(device="cuda:0", dtype="float32").for_checkpoint(raw).dtype == "float32"


def test_dtype_choice_is_validated() -> None:
    from mm_serve.config import ConfigError, load_config
    from mm_serve.ground.dtypes import resolve_dtype

    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("float64", {}, on_gpu=False)
    assert resolve_dtype("auto", {"text_config": {"dtype": "bfloat16"}}, on_gpu=True) == "bfloat16"
    assert resolve_dtype("auto", {"torch_dtype": "torch.float16"}, on_gpu=True) == "float16"
    assert resolve_dtype("auto", {"dtype": "bfloat16"}, on_gpu=False) == "float32"
    assert resolve_dtype("float16", {"dtype": "bfloat16"}, on_gpu=False) == "float16"
    with pytest.raises(ConfigError, match="dtype"):
        load_config(overrides={"dtype": "int8"})


@pytest.mark.parametrize("declared", ["garbage", "torch.bfloat16", 16])
def test_a_checkpoint_declaring_an_unknown_dtype_is_a_checkpoint_error(tiny_llama: Path, tmp_path: Path,
                                                                      declared: object) -> None:
    """transformers would fail on it later with a bare AttributeError; we name the file and the value."""
    from mm_serve.models.model_config import CheckpointError
    from mm_serve.models.registry import load_model_config

    model_dir = _with_declared_dtype(tiny_llama, tmp_path / "ckpt", None)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["dtype"] = declared
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config.json: dtype .* is not a torch element type"):
        load_model_config(model_dir)
    with pytest.raises(CheckpointError, match="is not a torch element type"):
        LLM(model=model_dir, mode="colocated", num_pages=16)
