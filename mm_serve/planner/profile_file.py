"""The measured-profile file: what ``mm-serve profile`` writes and ``--hardware`` reads.

A JSON object (format ``mm-serve-profile/1``)::

    {
      "format": "mm-serve-profile/1",
      "name": "cpu-2core",                      # profile name shown in plans
      "device": "2 x Xeon cores, torch 2.x",    # free text
      "memory_bytes": 17179869184,              # device memory per instance GPU/host
      "model": {... config.json ...},           # or a path to config.json / model dir,
                                                #   relative to this file
      "dtype": "float32",                       # optional: element type measured
      "intra_node_bandwidth": 1.0e10,           # optional, bytes/s per device
      "inter_node_bandwidth": 1.25e9,           # optional, bytes/s per device
      "collective_latency_s": 5.0e-5,           # optional, seconds
      "prefill": [{"tokens": 128, "batch": 1, "seconds": 0.051}, ...],
      "decode":  [{"batch": 4, "context": 256, "seconds": 0.012}, ...],
      "encode":  [{"images": 1, "seconds": 0.30}, ...],           # optional
      "tensor_parallel": [                      # optional: instances of more devices
        {"degree": 2, "prefill": [...], "decode": [...], "encode": [...]}, ...
      ]
    }

``tokens`` is the prompt length of each of ``batch`` sequences (``batch`` defaults
to 1); ``context`` is the KV length of each of ``batch`` decoding sequences; every
``seconds`` is one forward pass (a prefill batch, one decode step, an encode batch);
``images`` counts tower passes, images of the tower's square input size (a tiling family's
image takes several). A ``tensor_parallel`` entry holds the same kinds of points measured on
one instance of ``degree`` devices (on a CPU: one worker on ``degree`` torch threads, the
placement's "TP" there), the whole pass's time; the planner then prices instances of that
degree from them instead of dividing one device's times by the degree.
"""

from __future__ import annotations

import errno
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mm_serve.ground.dtypes import DTYPE_BYTES
from mm_serve.media.local_file import read_media_file
from mm_serve.planner.errors import ModelShapeError, ProfileError
from mm_serve.planner.model_shape import ModelShape, load_model_shape, shape_from_config

FORMAT = "mm-serve-profile/1"


@dataclass(frozen=True)
class PrefillPoint:
    tokens: int  # prompt tokens per sequence
    batch: int  # sequences
    seconds: float


@dataclass(frozen=True)
class DecodePoint:
    batch: int  # sequences
    context: int  # KV tokens per sequence
    seconds: float


@dataclass(frozen=True)
class EncodePoint:
    images: int  # tower passes (square images of the tower's input size)
    seconds: float


@dataclass(frozen=True)
class ParallelPoints:
    """Points measured on one instance of ``degree`` devices (threads on a CPU)."""

    degree: int
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    encode: tuple[EncodePoint, ...] = ()


@dataclass(frozen=True)
class Profile:
    """A parsed profile file (see the module docstring for units)."""

    name: str
    device: str
    memory_bytes: float
    shape: ModelShape
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    encode: tuple[EncodePoint, ...]
    intra_node_bandwidth: float | None = None
    inter_node_bandwidth: float | None = None
    collective_latency_s: float | None = None
    tensor_parallel: tuple[ParallelPoints, ...] = ()  # by degree, each above 1 and at most once
    measured_under_load: float | None = None  # others' busy share of the cores while measured (0..1), if over the limit


def _num(row: Mapping[str, Any], key: str, where: str, default: float | None = None,
         integer: bool = False) -> float:
    value = row.get(key, default)
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    kind = "a positive integer" if integer else "a positive finite number"
    if isinstance(value, bool) or not ok or value is None or value <= 0 or not _finite(value):
        raise ProfileError(f"{where}: '{key}' must be {kind}, got {_shown(value)}")
    return float(value)


def _finite(value: float) -> bool:
    """Finite as a float: an integer past float's range (a 400-digit memory size) is not."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _shown(value: Any) -> str:
    """``value`` for an error message, a huge integer by its digit count."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an integer of {len(str(abs(value)))} digits"
    return repr(value)


def _rows(data: Mapping[str, Any], key: str, where: str, required: bool) -> list[Mapping[str, Any]]:
    rows = data.get(key, [])
    if not isinstance(rows, list) or not all(isinstance(r, Mapping) for r in rows):
        raise ProfileError(f"{where}: '{key}' must be a list of objects")
    if required and not rows:
        raise ProfileError(f"{where}: '{key}' needs at least one measurement")
    return rows


def _shape(data: Mapping[str, Any], base: Path, where: str) -> ModelShape:
    model = data.get("model")
    try:
        if isinstance(model, Mapping):
            shape = shape_from_config(model, name=str(model.get("_name_or_path", "profiled")),
                                      where=f"{where}: model")
        elif isinstance(model, str):
            path = Path(model)
            shape = load_model_shape(path if path.is_absolute() else base / path)
        else:
            raise ProfileError(f"{where}: 'model' must be a config.json object or a path")
    except ModelShapeError as exc:
        raise ProfileError(str(exc)) from None
    dtype = data.get("dtype")
    if dtype is not None:
        if dtype not in DTYPE_BYTES:
            raise ProfileError(f"{where}: 'dtype' must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
        shape = replace(shape, dtype=dtype, dtype_bytes=DTYPE_BYTES[dtype])
    return shape


def parse_profile(data: Any, base: Path = Path("."), where: str = "profile") -> Profile:
    """Validate a decoded profile object; raises :class:`ProfileError` naming the field."""
    if not isinstance(data, Mapping):
        raise ProfileError(f"{where}: top level must be a JSON object")
    if data.get("format") != FORMAT:
        raise ProfileError(f"{where}: 'format' must be {FORMAT!r}, got {data.get('format')!r}")
    pre, dec, enc = _points(data, where)
    optional = {k: _num(data, k, where) if k in data else None
                for k in ("intra_node_bandwidth", "inter_node_bandwidth", "collective_latency_s")}
    return Profile(
        name=str(data.get("name", "profiled")), device=str(data.get("device", "")),
        memory_bytes=_num(data, "memory_bytes", where), shape=_shape(data, base, where),
        prefill=pre, decode=dec, encode=enc, **optional, tensor_parallel=_parallel(data, where),
        measured_under_load=_share(data, "measured_under_load", where),
    )


def _share(data: Mapping[str, Any], key: str, where: str) -> float | None:
    """``data[key]`` as a share in (0, 1], or None when absent; raises :class:`ProfileError` naming it."""
    if key not in data:
        return None
    share = _num(data, key, where)
    if share > 1:
        raise ProfileError(f"{where}: {key!r} must be a share between 0 and 1, got {data[key]!r}")
    return share


def _points(data: Mapping[str, Any], where: str) -> tuple[tuple[PrefillPoint, ...], tuple[DecodePoint, ...],
                                                           tuple[EncodePoint, ...]]:
    """The prefill, decode and encode points of ``data`` (prefill and decode required)."""
    pre = tuple(PrefillPoint(int(_num(r, "tokens", where, integer=True)),
                             int(_num(r, "batch", where, 1, integer=True)), _num(r, "seconds", where))
                for r in _rows(data, "prefill", where, True))
    dec = tuple(DecodePoint(int(_num(r, "batch", where, integer=True)),
                            int(_num(r, "context", where, integer=True)), _num(r, "seconds", where))
                for r in _rows(data, "decode", where, True))
    enc = tuple(EncodePoint(int(_num(r, "images", where, integer=True)), _num(r, "seconds", where))
                for r in _rows(data, "encode", where, False))
    return pre, dec, enc


def _parallel(data: Mapping[str, Any], where: str) -> tuple[ParallelPoints, ...]:
    """The ``tensor_parallel`` entries, each with a degree above 1 given once."""
    out: list[ParallelPoints] = []
    for i, entry in enumerate(_rows(data, "tensor_parallel", where, False)):
        at = f"{where}: tensor_parallel[{i}]"
        degree = int(_num(entry, "degree", at, integer=True))
        if degree < 2 or any(p.degree == degree for p in out):
            raise ProfileError(f"{at}: 'degree' must be above 1 and appear once, got {degree}")
        out.append(ParallelPoints(degree, *_points(entry, at)))
    return tuple(out)


MAX_PROFILE_BYTES = 16 << 20  # a profile is a few KB; a bigger file is not one (and is not read whole)


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile JSON file.

    Raises:
        ProfileError: not a regular file (a device or a pipe would be read without end), over
            :data:`MAX_PROFILE_BYTES`, unreadable, not JSON, or not a valid profile.
    """
    p = Path(path)
    try:
        data = json.loads(read_media_file(p, MAX_PROFILE_BYTES))  # a regular file, read within the cap
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise ProfileError(f"{p}: is not a regular file (a folder, a device or a pipe); give a profile JSON "
                               "file") from None
        if exc.errno == errno.EFBIG:
            raise ProfileError(f"{p}: over {MAX_PROFILE_BYTES} bytes is not a profile") from None
        raise ProfileError(f"cannot read profile {p}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{p}: not valid JSON: {exc}") from None
    return parse_profile(data, p.parent, str(p))


def points_to_json(prefill: Sequence[PrefillPoint], decode: Sequence[DecodePoint],
                   encode: Sequence[EncodePoint]) -> dict[str, list[dict[str, float]]]:
    """The ``prefill``, ``decode`` and ``encode`` rows of a profile (or of a ``tensor_parallel`` entry)."""
    return {"prefill": [{"tokens": p.tokens, "batch": p.batch, "seconds": p.seconds} for p in prefill],
            "decode": [{"batch": d.batch, "context": d.context, "seconds": d.seconds} for d in decode],
            "encode": [{"images": e.images, "seconds": e.seconds} for e in encode]}


def profile_to_json(
    name: str, device: str, memory_bytes: float, model: Mapping[str, Any] | str,
    prefill: list[PrefillPoint], decode: list[DecodePoint], encode: list[EncodePoint],
    dtype: str | None = None, tensor_parallel: Sequence[ParallelPoints] = (),
) -> dict[str, Any]:
    """The JSON object of a profile (for a profiler to ``json.dump``)."""
    out: dict[str, Any] = {"format": FORMAT, "name": name, "device": device,
                           "memory_bytes": memory_bytes, "model": model}
    if dtype:
        out["dtype"] = dtype
    out.update(points_to_json(prefill, decode, encode))
    if tensor_parallel:
        out["tensor_parallel"] = [{"degree": p.degree, **points_to_json(p.prefill, p.decode, p.encode)}
                                  for p in tensor_parallel]
    return out
