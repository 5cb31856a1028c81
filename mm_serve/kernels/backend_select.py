"""Pick the attention backend for a device and the configured choice (``attention_backend``)."""

from __future__ import annotations

import importlib.util

import torch

from mm_serve.kernels.attention_backend import AttentionBackend
from mm_serve.kernels.paged_attention_ref import TorchRefAttention

BACKEND_CHOICES = ("auto", "flex", "torch")


def select_attention_backend(device: torch.device, compiled_cpu: bool = True, choice: str = "auto") -> AttentionBackend:
    """The attention backend for ``device``.

    ``choice``:

    * ``torch``: the plain-torch reference (:class:`TorchRefAttention`: pages gathered into a
      padded copy, then SDPA), exact, and what every other backend is tested against.
    * ``flex``: :class:`~mm_serve.kernels.flex_paged_attention.FlexPagedAttention` (pages read in
      place through block masks), compiled with ``torch.compile`` on CUDA, eager on a CPU.
    * ``auto``: on CUDA, flash-attn (``mm_serve.kernels.flash_attention``, extra ``[gpu]``) when
      ``flash_attn`` imports (FlexAttention is not chosen by ``auto`` until it has run on a GPU:
      ``benchmarks/gpu_check.sh`` runs it); on a CPU with ``compiled_cpu``,
      :class:`~mm_serve.kernels.cpu_paged_attention.CompiledCpuAttention` when its kernel builds
      (:mod:`mm_serve.kernels.cpu_extension`; a failed build warns once); otherwise the reference.

    Raises:
        ValueError: ``choice`` is not one of :data:`BACKEND_CHOICES`.
        RuntimeError: ``flex`` chosen on a PyTorch without FlexAttention.
    """
    if choice not in BACKEND_CHOICES:
        raise ValueError(f"attention_backend must be one of {list(BACKEND_CHOICES)}, got {choice!r}")
    if choice == "torch":
        return TorchRefAttention()
    if choice == "flex":
        from mm_serve.kernels.flex_paged_attention import FlexPagedAttention

        return FlexPagedAttention(compiled=device.type == "cuda")
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
