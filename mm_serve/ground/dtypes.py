"""Element types of weights, KV pages and features: their names, sizes and torch types.

One table for the whole service: the configuration's ``dtype`` choices, the ring's page
sizes, the planner's profile files and the benchmarks all read it. torch is imported only
by :func:`torch_dtype`, so the ground floor stays light.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

if TYPE_CHECKING:
    import torch

DTypeName = Literal["float32", "bfloat16", "float16"]
"""The element types the engine, the rings and the planner support."""

DTYPE_NAMES: tuple[DTypeName, ...] = get_args(DTypeName)
"""Every :data:`DTypeName`, in declaration order (``float32`` first)."""

DTYPE_BYTES: MappingProxyType[str, int] = MappingProxyType({"float32": 4, "bfloat16": 2, "float16": 2})
"""Bytes per element of each :data:`DTypeName`."""


DTypeChoice = Literal["auto", "float32", "bfloat16", "float16"]
"""What a config may ask for: a :data:`DTypeName`, or ``auto`` (on a GPU the checkpoint's own, on a CPU
float32: :func:`resolve_dtype`)."""

DTYPE_CHOICES: tuple[DTypeChoice, ...] = get_args(DTypeChoice)


def declared_dtypes(raw: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """``(key, value)`` of each element type a checkpoint's ``config.json`` (``raw``) declares, in the
    order they count: ``dtype`` (transformers 5), then ``torch_dtype`` (earlier), at the top level,
    then in a multimodal checkpoint's ``text_config``."""
    text = raw.get("text_config")
    for section in (raw, text if isinstance(text, Mapping) else {}):
        for key in ("dtype", "torch_dtype"):
            if section.get(key) is not None:
                yield key, section[key]


def checkpoint_dtype(raw: Mapping[str, Any]) -> DTypeName:
    """The element type a checkpoint's ``config.json`` (``raw``) declares first (:func:`declared_dtypes`)
    among the :data:`DTypeName` s; ``float32`` when it declares none of them."""
    for _, value in declared_dtypes(raw):
        if isinstance(value, str) and value.removeprefix("torch.") in DTYPE_BYTES:
            return cast("DTypeName", value.removeprefix("torch."))
    return "float32"


def resolve_dtype(choice: str, raw: Mapping[str, Any], on_gpu: bool) -> DTypeName:
    """The element type to serve with: ``choice`` itself, or for ``auto``:

    * on a GPU (``on_gpu``: a worker of the pair runs on CUDA), the checkpoint's
      (:func:`checkpoint_dtype` of its ``config.json`` ``raw``);
    * on a CPU, float32: the compiled attention kernel and the packed linear layers are
      float32, and a half type decodes slower there (docs/attention.md has the figures).

    Raises:
        ValueError: ``choice`` is not one of :data:`DTYPE_CHOICES`.
    """
    if choice == "auto":
        return checkpoint_dtype(raw) if on_gpu else "float32"
    if choice not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {list(DTYPE_CHOICES)}, got {choice!r}")
    return cast("DTypeName", choice)


def torch_dtype(name: str) -> torch.dtype:
    """The ``torch.dtype`` named ``name`` (``"bfloat16"`` -> ``torch.bfloat16``).

    Raises:
        ValueError: ``name`` is not one of :data:`DTYPE_NAMES`.
    """
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {name!r}")
    import torch

    return cast("torch.dtype", getattr(torch, name))
