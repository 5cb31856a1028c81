"""Reference generation with Hugging Face transformers for the golden parity tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mm_serve import LLM, RequestOutput
from mm_serve.colocated.llm_engine import LLMEngine
from mm_serve.inputs.input_processor import ProcessedInputs
from mm_serve.runtime.kv_cache import pages_for
from mm_serve.runtime.request import Request
from mm_serve.runtime.sampling_params import SamplingParams


def load_reference(model_dir: Path, multimodal: bool) -> torch.nn.Module:
    """transformers' own model class for the checkpoint, float32, eval mode."""
    from transformers import LlamaForCausalLM, LlavaForConditionalGeneration

    cls = LlavaForConditionalGeneration if multimodal else LlamaForCausalLM
    return cls.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@torch.inference_mode()
def reference_generate(model: torch.nn.Module, inputs: ProcessedInputs, new_tokens: int,
                       model_kwargs: dict[str, Any] | None = None) -> tuple[list[int], torch.Tensor]:
    """Greedy ids of ``new_tokens`` tokens (EOS ignored) and first-step logits ``[vocab]`` (on the model's device).

    ``model_kwargs``: the family's image inputs to transformers' model (default: ``pixel_values`` alone,
    as LLaVA-1.5 takes them); tensors are moved to the model's device.
    """
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    ids = torch.tensor([inputs.prompt_token_ids], device=device)
    if model_kwargs is None:
        model_kwargs = {} if inputs.pixel_values is None else {"pixel_values": inputs.pixel_values}
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in model_kwargs.items()}
    first = model(input_ids=ids, **kwargs).logits[0, -1].float()
    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
    )
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # else transformers fills the config's unset EOS from it and stops there
    try:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config, **kwargs)
    finally:
        model.generation_config.eos_token_id = saved
    assert out.shape[1] == ids.shape[1] + new_tokens, "the reference stopped early"
    return out[0, ids.shape[1]:].tolist(), first


@torch.inference_mode()
def our_first_logits(engine: LLMEngine, inputs: ProcessedInputs) -> torch.Tensor:
    """First-step logits ``[vocab]`` from our runner (prefill of the prompt alone)."""
    request = Request("logits-probe", list(inputs.prompt_token_ids), SamplingParams(max_tokens=1),
                      num_images=inputs.num_images, pixel_values=inputs.pixel_values,
                      image_token_counts=list(inputs.image_token_counts), image_tiles=list(inputs.image_tiles),
                      image_sizes=list(inputs.image_sizes), image_second_per_grid=list(inputs.image_second_per_grid))
    pool = engine.kv_cache.pool
    request.block_table = pool.allocate(pages_for(request.num_tokens, engine.config.page_size))
    try:
        engine.runner.encode_images([request])
        return engine.runner.prefill([request])[0]
    finally:
        pool.free(request.block_table)


def assert_matches_reference(llm: LLM, reference: torch.nn.Module, request: dict[str, Any], new_tokens: int,
                             model_kwargs: Callable[[ProcessedInputs], dict[str, Any]] | None = None,
                             logits_rtol: float = 1e-4) -> RequestOutput:
    """Our colocated ``llm`` against transformers' ``reference`` on ``request``: first logits within
    ``logits_rtol`` (relative L2), the same ``new_tokens`` greedy tokens (EOS ignored), the prompt counted
    as processed. ``model_kwargs`` builds the family's image inputs to transformers' model from ours.
    Returns our output."""
    assert llm.engine is not None
    inputs = llm.engine.inputs.process(request)
    expected, ref_logits = reference_generate(reference, inputs, new_tokens,
                                              None if model_kwargs is None else model_kwargs(inputs))
    ours = our_first_logits(llm.engine, inputs)
    assert float((ours - ref_logits).norm() / ref_logits.norm()) <= logits_rtol
    out = llm.generate(request, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == expected and out.num_prompt_tokens == len(inputs.prompt_token_ids)
    return out
