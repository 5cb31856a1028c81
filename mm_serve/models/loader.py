"""Build a :class:`MultimodalLM` from a checkpoint directory and load its safetensors weights."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from mm_serve.kernels.backend_select import select_attention_backend
from mm_serve.kernels.cpu_linear import pack_linear_layers
from mm_serve.kernels.cpu_paged_attention import CompiledCpuAttention
from mm_serve.models.fused_weights import fuse_projections
from mm_serve.models.llama import LlamaForCausalLM, RMSNorm
from mm_serve.models.llava import MultimodalLM
from mm_serve.models.model_config import CheckpointError
from mm_serve.models.registry import load_model_config
from mm_serve.models.weights import PARTS, load_state_dicts


def _load_part(module: torch.nn.Module, state: dict[str, torch.Tensor], part: str, model_dir: Path) -> None:
    expected = set(module.state_dict().keys())
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if unexpected:
        raise CheckpointError(f"{model_dir}: unexpected {part} weights {unexpected[:5]}")
    if missing:
        raise CheckpointError(f"{model_dir}: missing {part} weights {missing[:5]}")
    shapes = module.state_dict()
    wrong = [f"{name} is {tuple(state[name].shape)}, config.json gives {tuple(shapes[name].shape)}"
             for name in sorted(expected) if state[name].shape != shapes[name].shape]
    if wrong:
        raise CheckpointError(f"{model_dir}: {part} weights do not match config.json ({len(wrong)}): "
                              + "; ".join(wrong[:3]))
    module.load_state_dict(state, strict=True)


def _uninitialised_tower(builds_tower: bool) -> AbstractContextManager[object]:
    """Where a vision tower is built: no random init (:mod:`mm_serve.models.skip_init`; every weight of
    the tower and projector is loaded after, strictly). Without one, transformers is not even imported."""
    if not builds_tower:
        return contextlib.nullcontext()
    from mm_serve.models.skip_init import no_init_weights

    return no_init_weights()  # type: ignore[no-any-return]


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    pack_cpu_linears: bool = True, compiled_cpu_kernels: bool = True, vision: bool = True,
    attention_backend: str = "auto",
) -> MultimodalLM:
    """Load a llava-hf or Llama checkpoint into our runner, in eval mode.

    With ``vision`` False a llava checkpoint's tower and projector are neither built nor
    loaded (:class:`MultimodalLM`: a decode worker's model).

    With ``pack_cpu_linears`` (float32 on a CPU), every linear layer, the vision
    tower's included, runs from oneDNN-packed weights (:mod:`mm_serve.kernels.cpu_linear`). With
    ``compiled_cpu_kernels`` (a CPU), float32 decode attention reads the paged cache in
    place with the compiled kernel (:mod:`mm_serve.kernels.cpu_paged_attention`) and RMSNorm runs as
    one compiled op (:mod:`mm_serve.kernels.cpu_extension`, built on first use). ``attention_backend``
    (auto, flex, torch) is :func:`~mm_serve.kernels.backend_select.select_attention_backend`'s ``choice``.

    Raises:
        CheckpointError: missing files, unsupported architecture, or weights that
            do not match the config (names listed in the message).
    """
    root = Path(model_dir)
    cfg = load_model_config(root)
    torch_device = torch.device(device)
    backend = select_attention_backend(
        torch_device, compiled_cpu=compiled_cpu_kernels and dtype == torch.float32, choice=attention_backend)
    # The decoder (the bulk of the weights) is built without initialising its
    # parameters; the vision tower is built normally for its non-persistent buffers.
    with torch.device("meta"):
        language_model = LlamaForCausalLM(cfg.text, backend)
    language_model = language_model.to_empty(device=torch_device)
    language_model.rotary.reset_inv_freq(torch_device)
    if cfg.text.tie_word_embeddings:
        language_model.lm_head.weight = language_model.embed_tokens.weight
    with _uninitialised_tower(vision and cfg.vision is not None):
        model = MultimodalLM(cfg, backend, language_model, vision=vision).to(torch_device)
    # without the tower, a llava checkpoint's vision and projector weights are not even read
    parts = load_state_dicts(root, PARTS if vision or cfg.vision is None else ("lm",))
    lm_state = parts["lm"]
    if cfg.text.tie_word_embeddings:
        lm_state.pop("lm_head.weight", None)
        lm_state["lm_head.weight"] = lm_state.get("embed_tokens.weight", torch.empty(0))
    try:
        lm_state = fuse_projections(lm_state, model.language_model.state_dict().keys())
    except CheckpointError as exc:
        raise CheckpointError(f"{root}: {exc}") from None
    _load_part(model.language_model, lm_state, "language-model", root)
    if model.vision is not None:
        _load_part(model.vision.tower, parts["vision"], "vision-tower", root)
    if model.projector is not None:
        _load_part(model.projector, parts["projector"], "projector", root)
        if model.image_newline is not None:
            newline = parts["newline"].get("image_newline")
            if newline is None:
                raise CheckpointError(f"{root}: a LLaVA-NeXT checkpoint without image_newline")
            with torch.no_grad():
                model.image_newline.copy_(newline)
    elif cfg.vision is None and (parts["vision"] or parts["projector"]):
        raise CheckpointError(f"{root}: vision weights present but config.json is text-only")
    model = model.to(dtype=dtype)
    language_model.rotary.reset_inv_freq(torch_device)  # keep frequencies in float32
    model.eval()
    if pack_cpu_linears and torch_device.type == "cpu" and dtype == torch.float32:
        pack_linear_layers(model)
    if isinstance(backend, CompiledCpuAttention):  # chosen only for compiled_cpu_kernels, float32, a CPU
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.compiled_kernel = backend.ops.rms_norm
    return model
