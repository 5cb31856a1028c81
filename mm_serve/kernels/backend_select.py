"""Pick the attention backend for a device: flash-attn on CUDA when installed, the compiled
in-place decode kernel on a CPU when it builds, else the torch reference."""

from __future__ import annotations

import importlib.util

import torch

from mm_serve.kernels.attention_backend import AttentionBackend
from mm_serve.kernels.paged_attention_ref import TorchRefAttention


def select_attention_backend(device: torch.device, compiled_cpu: bool = True) -> AttentionBackend:
    """Return the best available backend for ``device``.

    The flash-attn backend (``mm_serve.kernels.flash_attention``, extra ``[gpu]``) is used
    only when the device is CUDA and ``flash_attn`` imports. On a CPU with
    ``compiled_cpu``, :class:`~mm_serve.kernels.cpu_paged_attention.CompiledCpuAttention` when its
    kernel builds (:mod:`mm_serve.kernels.cpu_extension`; a failed build warns once). Otherwise
    the plain-torch reference, which is exact but slower.
    """
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        from mm_serve.kernels.flash_attention import FlashAttention

        return FlashAttention()
    if device.type == "cpu" and compiled_cpu:
        from mm_serve.kernels.cpu_extension import cpu_kernel_ops
        from mm_serve.kernels.cpu_paged_attention import CompiledCpuAttention

        ops = cpu_kernel_ops()
        if ops is not None:
            return CompiledCpuAttention(ops)
    return TorchRefAttention()
