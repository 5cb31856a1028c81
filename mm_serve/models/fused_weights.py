"""Stack Hugging Face's separate projection weights into our runner's fused ones.

Our decoder runs one matmul for Q, K and V (``self_attn.qkv_proj``, output rows
``[q | k | v]``) and one for the MLP's gate and up projections
(``mlp.gate_up_proj``, rows ``[gate | up]``): fewer, larger GEMMs per layer and
fewer operator calls per decode step (the stacked-parameter layout of vLLM's
``QKVParallelLinear`` / ``MergedColumnParallelLinear``). Checkpoints keep the
Hugging Face names; the loader stacks them with :func:`fuse_projections`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mm_serve.models.model_config import CheckpointError

FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_projections(state: dict[str, torch.Tensor], expected: Iterable[str]) -> dict[str, torch.Tensor]:
    """Replace, for every fused key in ``expected``, its Hugging Face parts in ``state`` by their
    concatenation along dim 0 (output rows); other keys pass through unchanged.

    Args:
        state: decoder weights by Hugging Face name (``layers.0.self_attn.q_proj.weight``, ...).
        expected: the keys of our module's ``state_dict()`` (``layers.0.self_attn.qkv_proj.weight``, ...).
    Returns:
        A new dict keyed like our module.
    Raises:
        CheckpointError: naming the Hugging Face keys missing for a fused weight.
    """
    out = dict(state)
    for key in expected:
        for fused, parts in FUSED_PROJECTIONS.items():
            marker = f".{fused}."
            if marker not in f".{key}":
                continue
            prefix, suffix = f".{key}".split(marker, 1)
            prefix = prefix[1:] + "." if prefix else ""
            names = [f"{prefix}{part}.{suffix}" for part in parts]
            missing = [name for name in names if name not in out]
            if missing:
                raise CheckpointError(f"missing language-model weights {missing}")
            out[key] = torch.cat([out.pop(name) for name in names], dim=0)
    return out
