"""Linear layers on oneDNN with pre-packed weights, for float32 on the CPU.

PyTorch's CPU ``F.linear`` calls MKL's ``sgemm``, which on the AMD Zen 5 cores
of our CI machines runs at ~100 GFLOP/s per core; oneDNN with the weight
reordered once into its blocked layout runs the same GEMMs at 2.2-2.5x that
(measured by ``benchmarks/cpu_gemm.py``). This is the path Inductor takes on the
CPU after weight freezing (``mkldnn::_reorder_linear_weight`` +
``mkldnn::_linear_pointwise``), and the approach of vLLM's and IPEX's CPU
backends: pack the weights at load time, run every GEMM from the packed copy.

Results differ from MKL's in float32 rounding only (relative ~1e-7: the
summation order differs), like any two BLAS libraries. Very small GEMMs (one or
two rows against a small matrix, a decode step at batch 1) are faster on MKL,
so :class:`PackedLinear` keeps the dense weight and sends products under
:data:`MIN_PACKED_MACS` multiply-accumulates there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# rows x in_features x out_features at and above which the packed oneDNN GEMM
# is faster than MKL on one Zen 5 core (benchmarks/cpu_gemm.py: at 1 row MKL wins
# below ~1M MACs, at 2 rows below ~0.5M; oneDNN wins everything from 4 rows up
# except the smallest matrices)
MIN_PACKED_MACS = 1 << 19


def onednn_linear_available() -> bool:
    """True when this torch build has oneDNN and the two ops of the packed linear path."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """A drop-in for a float32 CPU ``nn.Linear`` that also holds a oneDNN-packed weight.

    ``weight`` ``[out, in]`` and ``bias`` ``[out]`` are the original parameters (so
    ``state_dict`` keys and tied weights are unchanged); the packed copy is an
    opaque oneDNN tensor, made at construction and again after any in-place write
    to ``weight`` (its version counter moved). Input ``[..., in]`` → output ``[..., out]``.

    Args:
        linear: the layer to wrap (float32, on the CPU).
    Raises:
        ValueError: the layer is not float32 on the CPU.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if linear.weight.device.type != "cpu" or linear.weight.dtype != torch.float32:
            raise ValueError(f"PackedLinear needs a float32 CPU layer, got {linear.weight.dtype} on {linear.weight.device}")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._pack()
        self.min_rows = max(1, -(-MIN_PACKED_MACS // (self.in_features * self.out_features)))

    def _pack(self) -> None:
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        # inference tensors keep no version counter: such a weight is never repacked
        self.packed_version = None if self.weight.is_inference() else self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if x.dim() else 0
        if rows < self.min_rows or x.dtype != torch.float32 or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        if self.packed_version is not None and self.weight._version != self.packed_version:  # written in place since packing (a test, a weight update)
            self._pack()
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, oneDNN-packed"


def pack_linear_layers(module: nn.Module) -> int:
    """Replace every float32 CPU ``nn.Linear`` inside ``module`` by a :class:`PackedLinear`.

    Does nothing (returns 0) when oneDNN is unavailable. Call it after the weights
    are loaded: the packed copies are made from the current values.

    Returns:
        The number of layers replaced.
    """
    if not onednn_linear_available():
        return 0
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32:
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced
