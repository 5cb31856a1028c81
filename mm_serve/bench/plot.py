"""SLO attainment against request rate, one curve per system (matplotlib, PNG).

Filled markers are complete runs; open markers are runs stopped early once the
target was out of reach (their attainment is a lower bound). The dashed line is the
attainment target, the dotted verticals each system's goodput.

Several benchmark JSON files (``mm-serve bench --out``) can be merged into one figure::

    python -m mm_serve.bench.plot bench_out/ours/bench.json bench_out/vllm/bench.json \\
        --out goodput_chatbot.png --title "chatbot workload"
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Curve:
    """One system's runs: rates (requests/s), attainments (0..1), early-stop flags, goodput."""

    label: str
    rates: tuple[float, ...]
    attainments: tuple[float, ...]
    stopped_early: tuple[bool, ...]
    goodput: float | None


def curves_from_json(doc: dict[str, Any], label_prefix: str = "") -> list[Curve]:
    """The curves of one benchmark JSON document (the ``systems`` that have loaded runs).

    Raises:
        ValueError: ``systems`` is not a list, or a run's rate is not a positive finite number, its
            attainment not within 0..1, or a goodput not a finite number (also TypeError, KeyError
            or AttributeError for other shapes that are no ``mm-serve bench --out`` result).
    """
    systems = doc.get("systems")
    if not isinstance(systems, list):
        raise ValueError("no 'systems' list")
    curves = []
    repeated = any(int(system.get("round", 1)) > 1 for system in systems)
    for system in systems:
        runs = system.get("sweep", {}).get("runs") if system.get("sweep") else None
        if runs is None:
            runs = [system["single"]] if system.get("single") else []
        runs = [r for r in runs if r.get("attainment") is not None]
        if not runs:
            continue
        goodput = system.get("goodput")
        curves.append(Curve(
            label=label_prefix + str(system["name"]) + (f" #{system['round']}" if repeated else ""),
            rates=tuple(_number(r["rate"], "rate", low=0.0, low_open=True) for r in runs),
            attainments=tuple(_number(r["attainment"], "attainment", low=0.0, high=1.0) for r in runs),
            stopped_early=tuple(bool(r.get("stopped_early")) for r in runs),
            goodput=None if goodput is None else _number(goodput, "goodput", low=0.0),
        ))
    return curves


def _number(value: Any, name: str, low: float, high: float = math.inf, low_open: bool = False) -> float:
    """``value`` as a float within [low, high] (above ``low`` when ``low_open``), else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} {value!r} is not a number")
    number = float(value)  # OverflowError for an integer past a float's range: the caller's too
    if not math.isfinite(number) or number < low or (low_open and number == low) or number > high:
        raise ValueError(f"{name} {value!r} is out of range")
    return number


def plot_attainment(curves: Sequence[Curve], target: float, path: Path, title: str = "") -> Path:
    """Write the attainment-vs-rate figure of ``curves`` to ``path`` (its format from the suffix: PNG,
    PDF, SVG, ...); returns ``path``. Titles and labels are drawn as written (a ``$`` is no TeX).

    Raises:
        ValueError: ``path``'s suffix is no image format matplotlib writes. OSError: it cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with matplotlib.rc_context({"text.parse_math": False}):
        _draw(plt, curves, target, path, title)
    return path


def image_formats() -> set[str]:
    """The file suffixes (no dot) :func:`plot_attainment` writes: matplotlib's Agg formats."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.backend_bases import FigureCanvasBase

    return set(FigureCanvasBase.get_supported_filetypes())


def _draw(plt: Any, curves: Sequence[Curve], target: float, path: Path, title: str) -> None:
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in image_formats():
        raise ValueError(f"{path}: give a file name ending in an image format (.png, .pdf, .svg, ...), "
                         f"not {('.' + suffix) if suffix else 'no suffix'}")
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for i, curve in enumerate(curves):
        color = f"C{i}"
        order = sorted(range(len(curve.rates)), key=lambda k: curve.rates[k])
        xs = [curve.rates[k] for k in order]
        ys = [100 * curve.attainments[k] for k in order]
        label = curve.label + (f" (goodput {curve.goodput:.2f} req/s)" if curve.goodput else "")
        ax.plot(xs, ys, "-", color=color, label=label)
        for k in order:
            face = "none" if curve.stopped_early[k] else color
            ax.plot(curve.rates[k], 100 * curve.attainments[k], "o", color=color, markerfacecolor=face)
        if curve.goodput:
            ax.axvline(curve.goodput, color=color, linestyle=":", linewidth=1)
    ax.axhline(100 * target, color="gray", linestyle="--", linewidth=1, label=f"target {100 * target:.0f} %")
    ax.set_xscale("log")
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(-2, 102)
    ax.grid(True, which="both", alpha=0.3)
    if title:
        ax.set_title(title)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Merge benchmark JSON files into one plot (command line in the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m mm_serve.bench.plot",
                                     description="Plot SLO attainment vs rate from mm-serve bench JSON files.")
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="PNG path")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    curves: list[Curve] = []
    target = 0.9
    for f in args.files:
        doc = _read_bench_json(f, parser)
        try:
            target = float(doc.get("slo", {}).get("attainment_target", target))
            curves += curves_from_json(doc)
        except (AttributeError, KeyError, OverflowError, TypeError, ValueError) as exc:
            parser.error(f"{f}: not an `mm-serve bench --out` result ({type(exc).__name__}: {exc})")
    if not curves:
        parser.error("no system in these files has a measured run to plot")
    if args.out.is_dir():
        parser.error(f"--out {args.out}: is a folder; give the figure's file name (e.g. goodput.png)")
    try:
        plot_attainment(curves, target, args.out, args.title)
    except ValueError as exc:
        parser.error(f"--out {exc}")
    except OSError as exc:
        parser.error(f"cannot write {args.out}: {exc.strerror or exc}")
    print(args.out)
    return 0


def _read_bench_json(path: Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The JSON object in ``path``; a usage error (exit 2) names the file when it cannot be read."""
    if path.exists() and not path.is_file():  # a folder, or a FIFO that would wait for a writer
        parser.error(f"{path}: not a regular file")
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        parser.error(f"cannot read {path}: {exc.strerror or exc}")
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        parser.error(f"{path}: not JSON ({type(exc).__name__}: {exc})")
    if not isinstance(doc, dict):
        parser.error(f"{path}: not an `mm-serve bench --out` result (a JSON {type(doc).__name__})")
    return doc


if __name__ == "__main__":
    raise SystemExit(main())
