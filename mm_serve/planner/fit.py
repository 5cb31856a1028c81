"""Fit a measured profile into the latency model's roofline coefficients.

Each phase's time is ``t = a * FLOPs + b * bytes + c`` (see
:mod:`mm_serve.planner.hardware`), with FLOPs and bytes of each measured point
computed from the profiled model's shape (:mod:`mm_serve.planner.work`). The fit is
non-negative least squares on the *relative* error (each row divided by its measured
time, so millisecond decode steps weigh as much as second-long prefills), solved
exactly by trying every subset of free coefficients (Lawson and Hanson, "Solving
Least Squares Problems", 1974, ch. 23: the NNLS optimum is an unconstrained LS
optimum on its support).

Decode points vary batch and context, so they identify all three of seconds per
FLOP, seconds per byte and the overhead. Prefill and encode FLOPs and bytes grow
together with the prompt, so their byte coefficient is not identifiable from their
own points: it is taken from the decode fit (one memory system), and only seconds
per FLOP and the overhead are fitted. A phase with a single point gets seconds per
FLOP only; a profile without encode points reuses the prefill coefficients.

:func:`get_hardware` resolves a ``--hardware`` argument: a built-in datasheet profile
(:data:`mm_serve.planner.hardware.SPECS`) by name, or a measured profile file fitted here.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np

from mm_serve.planner.errors import HardwareError, ProfileError
from mm_serve.planner.hardware import (
    SPECS,
    Hardware,
    ParallelCoefficients,
    PhaseCoefficients,
    hardware_names,
)
from mm_serve.planner.model_shape import ModelShape
from mm_serve.planner.profile_file import (
    DecodePoint,
    EncodePoint,
    PrefillPoint,
    Profile,
    load_profile,
)
from mm_serve.planner.work import decode_work, encode_work, prefill_work

DEFAULT_INTRA_NODE_BANDWIDTH = 25e9  # bytes/s: PCIe 4.0 x16, when a profile gives none
DEFAULT_INTER_NODE_BANDWIDTH = 1.25e9  # bytes/s: 10 Gb Ethernet
DEFAULT_COLLECTIVE_LATENCY_S = 50e-6


@dataclass(frozen=True)
class PhaseFit:
    """Fitted coefficients of one phase and how well they reproduce the points."""

    coefficients: PhaseCoefficients
    points: int
    max_rel_error: float  # max over points of |predicted - measured| / measured
    rms_rel_error: float


@dataclass(frozen=True)
class ProfileFit:
    """A fitted :class:`Hardware` plus per-phase fit quality."""

    hardware: Hardware
    shape: ModelShape
    prefill: PhaseFit
    decode: PhaseFit
    encode: PhaseFit | None


def nnls(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Minimise ``sum(((rows @ x) - y) / y)^2`` subject to ``x >= 0``.

    Exhaustive over supports, so only for a handful of columns. Columns are scaled
    to unit maximum before solving. Returns zeros if no support gives ``x >= 0``.

    Raises:
        ProfileError: the least-squares solve fails (degenerate measurements, e.g.
            times many orders of magnitude apart).
    """
    with np.errstate(all="ignore"):  # overflow is checked just below
        a = np.asarray(rows, dtype=float) / np.asarray(y, dtype=float)[:, None]
        scale = np.abs(a).max(axis=0)
        scale[scale == 0] = 1.0
        a = a / scale
    if not np.all(np.isfinite(a)):
        raise ProfileError("the measurements cannot be fitted (work over time overflows); check "
                           "their 'seconds' values")
    ones = np.ones(len(y))
    cols = a.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for k in range(1, min(cols, len(y)) + 1):
        for support in itertools.combinations(range(cols), k):
            try:
                sol, *_ = np.linalg.lstsq(a[:, support], ones, rcond=None)
            except np.linalg.LinAlgError as exc:
                raise ProfileError(f"the measurements cannot be fitted ({exc}); check their "
                                   "'seconds' values") from None
            if np.any(sol < 0):
                continue
            x = np.zeros(cols)
            x[list(support)] = sol
            err = float(np.sum((a @ x - ones) ** 2))
            if best is None or err < best[0] - 1e-15:
                best = (err, x)
    return [0.0] * cols if best is None else [float(v) for v in best[1] / scale]


def _quality(pred: Sequence[float], meas: Sequence[float]) -> tuple[float, float]:
    rel = [abs(p - m) / m for p, m in zip(pred, meas, strict=True)]
    return float(max(rel)), float(np.sqrt(np.mean(np.square(rel))))


def _fit_compute(
    works: Sequence[tuple[float, float]], seconds: Sequence[float], per_byte: float
) -> PhaseFit:
    """Fit seconds-per-FLOP and overhead with the byte coefficient fixed."""
    rest = [t - b * per_byte for (_, b), t in zip(works, seconds, strict=True)]
    if min(rest) <= 0:
        raise ProfileError("measured times are shorter than the fitted memory traffic alone; "
                           "check the profile's model and dtype")
    rows = [[f, 1.0] for f, _ in works] if len(works) > 1 else [[f] for f, _ in works]
    x = nnls(rows, rest) + [0.0]
    coef = PhaseCoefficients(x[0], per_byte, x[1])
    pred = [coef.time(f, b) for f, b in works]
    return PhaseFit(coef, len(works), *_quality(pred, seconds))


def _fit_phases(shape: ModelShape, prefill: Sequence[PrefillPoint], decode: Sequence[DecodePoint],
                encode: Sequence[EncodePoint], where: str) -> tuple[PhaseFit, PhaseFit, PhaseFit | None]:
    """Prefill, decode and encode (None without points) fits of one set of points (see module doc);
    ``where`` starts each error message."""
    layers = shape.num_layers
    dec_works = [decode_work(shape, d.batch, d.batch * d.context, layers) for d in decode]
    dec_t = [d.seconds for d in decode]
    x = nnls([[w.flops, w.bytes, 1.0] for w in dec_works], dec_t)
    if not any(x):
        raise ProfileError(f"{where}decode points could not be fitted by a non-negative roofline")
    coef = PhaseCoefficients(*x)
    dec_fit = PhaseFit(coef, len(dec_t), *_quality([coef.time(w.flops, w.bytes) for w in dec_works], dec_t))

    pre_works = [prefill_work(shape, p.batch * p.tokens, p.batch * p.tokens**2, p.batch, layers) for p in prefill]
    pre_fit = _fit_compute([(w.flops, w.bytes) for w in pre_works], [p.seconds for p in prefill],
                           coef.seconds_per_byte)
    enc_fit = None
    if encode:
        if shape.vision is None:
            raise ProfileError(f"{where}profile has encode points but its model has no vision tower")
        enc_works = [encode_work(shape, e.images) for e in encode]
        enc_fit = _fit_compute([(w.flops, w.bytes) for w in enc_works], [e.seconds for e in encode],
                               coef.seconds_per_byte)
    return pre_fit, dec_fit, enc_fit


def fit_profile(profile: Profile) -> ProfileFit:
    """Least-squares coefficients for every phase of ``profile`` (see module doc), and the same fits
    of every ``tensor_parallel`` degree it measured (a degree without encode points takes the
    single device's encode coefficients, or its own prefill's when there are none).

    Raises:
        ProfileError: the points cannot be fitted (e.g. all coefficients zero).
    """
    shape = profile.shape
    pre_fit, dec_fit, enc_fit = _fit_phases(shape, profile.prefill, profile.decode, profile.encode, "")
    parallel = {}
    for points in profile.tensor_parallel:
        pre, dec, enc = _fit_phases(shape, points.prefill, points.decode, points.encode,
                                    f"tensor_parallel degree {points.degree}: ")
        encode = enc or enc_fit or pre
        parallel[points.degree] = ParallelCoefficients(pre.coefficients, dec.coefficients, encode.coefficients)
    hardware = Hardware(
        name=profile.name,
        memory_bytes=profile.memory_bytes,
        prefill=pre_fit.coefficients,
        decode=dec_fit.coefficients,
        encode=enc_fit.coefficients if enc_fit else pre_fit.coefficients,
        intra_node_bandwidth=profile.intra_node_bandwidth or DEFAULT_INTRA_NODE_BANDWIDTH,
        inter_node_bandwidth=profile.inter_node_bandwidth or DEFAULT_INTER_NODE_BANDWIDTH,
        collective_latency_s=profile.collective_latency_s or DEFAULT_COLLECTIVE_LATENCY_S,
        tensor_parallel=MappingProxyType(parallel),
    )
    return ProfileFit(hardware, shape, pre_fit, dec_fit, enc_fit)


def fit_profile_file(path: str | Path) -> ProfileFit:
    """:func:`load_profile` then :func:`fit_profile`."""
    return fit_profile(load_profile(path))


def get_hardware(name_or_path: str) -> Hardware:
    """A built-in profile by name, or a fitted one from a profile JSON file (:func:`resolve_hardware`)."""
    return resolve_hardware(name_or_path)[0]


def resolve_hardware(name_or_path: str) -> tuple[Hardware, Profile | None]:
    """A built-in profile by name, or a fitted one from a profile JSON file; with the parsed file (None
    for a built-in name).

    Raises:
        HardwareError: the name is unknown and no such file exists, or the path is a folder (or
            another file that is not a regular one).
        ProfileError: the file is not a valid or fittable profile (see
            :mod:`mm_serve.planner.profile_file`).
    """
    key = name_or_path.lower()
    if key in SPECS:
        return SPECS[key].to_hardware(), None
    path = Path(name_or_path)
    if path.is_file():
        profile = load_profile(path)
        return fit_profile(profile).hardware, profile
    if path.exists():
        raise HardwareError(f"hardware profile {name_or_path} is not a file (give a profile JSON file, "
                            "as `mm-serve profile --out` writes)")
    if key.endswith(".json") or "/" in name_or_path:
        raise HardwareError(f"hardware profile file not found: {name_or_path}")
    raise HardwareError(
        f"unknown hardware '{name_or_path}': choose {', '.join(hardware_names())} "
        "or give a profile JSON file"
    )
