"""Element types of weights, KV pages and features: their names, sizes and torch types.

One table for the whole service: the configuration's ``dtype`` choices, the ring's page
sizes, the planner's profile files and the benchmarks all read it. torch is imported only
by :func:`torch_dtype`, so the ground floor stays light.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Literal, cast, get_args

if TYPE_CHECKING:
    import torch

DTypeName = Literal["float32", "bfloat16", "float16"]
"""The element types the engine, the rings and the planner support."""

DTYPE_NAMES: tuple[DTypeName, ...] = get_args(DTypeName)
"""Every :data:`DTypeName`, in declaration order (``float32`` first)."""

DTYPE_BYTES: MappingProxyType[str, int] = MappingProxyType({"float32": 4, "bfloat16": 2, "float16": 2})
"""Bytes per element of each :data:`DTypeName`."""


def torch_dtype(name: str) -> torch.dtype:
    """The ``torch.dtype`` named ``name`` (``"bfloat16"`` -> ``torch.bfloat16``).

    Raises:
        ValueError: ``name`` is not one of :data:`DTYPE_NAMES`.
    """
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {name!r}")
    import torch

    return cast("torch.dtype", getattr(torch, name))
