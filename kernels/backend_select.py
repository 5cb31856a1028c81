"""Pick the attention backend for a device: flash-attn on CUDA when installed, else the torch reference."""

from __future__ import annotations

import importlib.util

import torch

from kernels.attention_backend import AttentionBackend
from kernels.paged_attention_ref import TorchRefAttention


def select_attention_backend(device: torch.device) -> AttentionBackend:
    """Return the best available backend for ``device``.

    The flash-attn backend (``kernels.flash_attention``, extra ``[gpu]``) is used
    only when the device is CUDA and ``flash_attn`` imports; otherwise the
    plain-torch reference, which is exact but slower.
    """
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        from kernels.flash_attention import FlashAttention

        return FlashAttention()
    return TorchRefAttention()
