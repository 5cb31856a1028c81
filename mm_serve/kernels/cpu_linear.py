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
so :class:`PackedLinear` keeps the dense weight of small layers and sends
products under :data:`MIN_PACKED_MACS` multiply-accumulates there; larger layers
keep only the packed copy, so a big model's weights are not held twice.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, cast

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
    """A drop-in for a float32 CPU ``nn.Linear`` that runs from a oneDNN-packed weight.

    ``bias`` ``[out]`` stays the original parameter. ``weight`` ``[out, in]``:

    * ``keep_dense=True`` (layers small enough that :data:`MIN_PACKED_MACS` sends some
      products to ``F.linear``, and weights shared with another module such as tied
      embeddings): the original parameter stays too, and the packed copy is made again
      after any in-place write to it (its version counter moved);
    * ``keep_dense=False``: only the packed copy is kept (no second copy of the layer in
      memory). ``weight`` then reads back a fresh dense tensor (writing into it changes
      nothing; assign ``layer.weight = ...`` or use ``load_state_dict`` to change it);
      ``state_dict`` still holds ``weight``. Pickling, ``copy.deepcopy`` and ``.to()`` /
      ``.half()`` work as for ``nn.Linear`` (the packed copy is remade or dropped).

    Products run on oneDNN only in inference (no autograd, no CPU autocast) with
    float32 CPU inputs of at least ``min_rows`` rows; anything else goes to ``F.linear``.

    Input ``[..., in]`` → output ``[..., out]``.

    Args:
        linear: the layer to wrap (float32, on the CPU).
        keep_dense: keep the dense parameter; default: only where ``F.linear`` is used
            for small products (``min_rows > 1``).
    Raises:
        ValueError: the layer is not float32 on the CPU, or has no weights.
    """

    def __init__(self, linear: nn.Linear, keep_dense: bool | None = None) -> None:
        super().__init__()
        if linear.weight.device.type != "cpu" or linear.weight.dtype != torch.float32:
            raise ValueError(f"PackedLinear needs a float32 CPU layer, got {linear.weight.dtype} on {linear.weight.device}")
        if linear.in_features * linear.out_features == 0:
            raise ValueError(f"PackedLinear needs a non-empty layer, got {linear.in_features} x {linear.out_features}")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.min_rows = max(1, -(-MIN_PACKED_MACS // (self.in_features * self.out_features)))
        self.keep_dense = self.min_rows > 1 if keep_dense is None else keep_dense
        self.packed: torch.Tensor | None = None
        self._packed_source: torch.Tensor | None = None
        self.packed_version: int | None = None
        self._pack(linear.weight)
        if self.keep_dense:  # (register_parameter would refuse the name: it is the property below)
            self._parameters["weight"] = cast(nn.Parameter, linear.weight)
        self.bias = linear.bias

    @property  # type: ignore[override]
    def weight(self) -> torch.Tensor:
        """The dense ``[out, in]`` weight: the parameter itself, or a copy read back from the packed one."""
        dense = self._parameters.get("weight")
        if dense is not None or self.packed is None:
            return cast(torch.Tensor, dense)
        return self.packed.to_dense()

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "weight":  # a new weight: kept dense, repacked on the next packed call
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"weight must be a tensor, got {type(value).__name__}")
            self._parameters["weight"] = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=False)
            self.keep_dense = True
            return
        super().__setattr__(name, value)

    def _pack(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        # a plain attribute, not a second registration of the parameter
        object.__setattr__(self, "_packed_source", weight if self.keep_dense else None)
        # inference tensors keep no version counter: such a weight is never repacked
        self.packed_version = None if weight.is_inference() else weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if x.dim() else 0
        if (self.packed is None or x.shape[-1:] != (self.in_features,) or rows < self.min_rows
                or x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled()
                or torch.is_autocast_enabled("cpu")):
            return F.linear(x, self.weight, self.bias)  # (also gives the usual shape and dtype errors)
        dense = self._parameters.get("weight")
        if dense is not None and (dense is not self._packed_source or (
                self.packed_version is not None and dense._version != self.packed_version)):
            self._pack(dense)  # replaced, or written in place, since packing (a test, a weight update)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """``.to()``, ``.half()``, ... act on the dense weight; the packed copy is remade while it
        stays float32 on the CPU, and dropped (plain ``F.linear``) otherwise."""
        packed_only = not self.keep_dense
        if packed_only:
            assert self.packed is not None
            self._parameters["weight"] = nn.Parameter(self.packed.to_dense(), requires_grad=False)
            self.keep_dense = True
        self.packed = self._packed_source = None
        out = super()._apply(fn, recurse)
        weight = self._parameters["weight"]
        assert weight is not None
        if weight.device.type == "cpu" and weight.dtype == torch.float32:
            self.keep_dense = not packed_only
            self._pack(weight)
            if packed_only:
                del self._parameters["weight"]
        return out

    def __getstate__(self) -> dict[str, object]:
        """Pickling and ``copy.deepcopy``: the opaque packed tensor travels as the dense weight."""
        state = self.__dict__.copy()
        state["_parameters"] = dict(self._parameters)
        if not self.keep_dense and self.packed is not None:
            state["_parameters"]["weight"] = nn.Parameter(self.packed.to_dense(), requires_grad=False)
        state["packed"] = state["_packed_source"] = None
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        super().__setstate__(state)
        weight = self._parameters.get("weight")
        if weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32:
            self._pack(weight)
            if not self.keep_dense:
                del self._parameters["weight"]

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        if not self.keep_dense:
            destination[prefix + "weight"] = self.weight
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,  # type: ignore[no-untyped-def]
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if self.keep_dense:
            return
        key = prefix + "weight"
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        if key not in state_dict:
            missing_keys.append(key)
        elif tuple(state_dict[key].shape) != (self.out_features, self.in_features):
            error_msgs.append(f"size mismatch for {key}: {tuple(state_dict[key].shape)} in the checkpoint, "
                              f"{(self.out_features, self.in_features)} here")
        else:
            self._pack(state_dict[key].to(torch.float32))

    def extra_repr(self) -> str:
        kept = "dense kept" if self.keep_dense else "packed only"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, oneDNN-packed, {kept}"


def pack_linear_layers(module: nn.Module) -> int:
    """Replace every float32 CPU ``nn.Linear`` inside ``module`` by a :class:`PackedLinear`.

    Does nothing (returns 0) when oneDNN is unavailable. Call it after the weights
    are loaded: the packed copies are made from the current values. Layers whose
    weight is also another module's parameter (tied embeddings) keep it dense.

    Returns:
        The number of layers replaced.
    """
    if not onednn_linear_available():
        return 0
    uses = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32
                    and child.weight.numel() > 0):
                shared = uses[id(child.weight)] > 1
                setattr(parent, name, PackedLinear(child, keep_dense=True if shared else None))
                replaced += 1
    return replaced
