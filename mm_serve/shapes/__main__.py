"""Command line: ``python -m mm_serve.shapes {train,eval,draw}``.

Examples::

    python -m mm_serve.shapes draw --out scene.png --seed 3   # prints the caption
    python -m mm_serve.shapes train --out /tmp/shapes --seed 0
    python -m mm_serve.shapes eval                       # the embedded checkpoint
    python -m mm_serve.shapes eval --model /tmp/shapes --n 500 --seed 0 --backend hf
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from mm_serve.models.named_models import resolve_model

if TYPE_CHECKING:
    from mm_serve.shapes.evaluate import GenerateFn


def _train(args: argparse.Namespace) -> int:
    from mm_serve.shapes.train import TrainConfig, train

    cfg = TrainConfig(seed=args.seed, threads=args.threads)
    if args.steps is not None:
        cfg = replace(cfg, steps=args.steps)
    if args.qa_steps is not None:
        cfg = replace(cfg, qa_steps=args.qa_steps)
    if args.question_probe_weight is not None:
        cfg = replace(cfg, question_probe_weight=args.question_probe_weight)
    result = train(Path(args.out), cfg, start_stage=args.start_stage)
    print(
        f"trained in {result.seconds / 60:.1f} min (CPU {result.cpu_seconds / 60:.1f} min), "
        f"final loss {result.final_loss:.4f}; saved to {result.out_dir}"
    )
    return 0


def _generate_fn(backend: str, model_dir: Path) -> tuple[GenerateFn, str]:
    from mm_serve.shapes.evaluate import hf_generate_fn, mm_serve_generate_fn

    if backend == "mm_serve":
        try:
            return mm_serve_generate_fn(model_dir), "mm_serve"
        except ImportError as exc:
            print(
                f"note: mm-serve's engine is not available ({exc}); falling back to --backend hf "
                "(transformers' LlavaForConditionalGeneration.generate)",
                file=sys.stderr,
            )
    return hf_generate_fn(model_dir), "hf"


def _record(model_dir: Path, text: str) -> None:
    """Replace (or add) the ``## Evaluation`` section of ``TRAINING.md`` in ``model_dir``."""
    path = model_dir / "TRAINING.md"
    old = path.read_text() if path.exists() else "# Training record\n"
    kept = re.split(r"\n## Evaluation\n", old, maxsplit=1)[0].rstrip("\n")
    path.write_text(f"{kept}\n\n## Evaluation\n\n{text}\n")


def _eval(args: argparse.Namespace) -> int:
    import torch

    from mm_serve.shapes.evaluate import evaluate

    for flag, value in (("--n", args.n), ("--batch-size", args.batch_size)):
        if value < 1:
            print(f"error: {flag} must be at least 1, got {value}", file=sys.stderr)
            return 2
    if args.threads < 0:
        print(f"error: --threads must be 0 or more, got {args.threads}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model_dir = resolve_model(args.model)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    generate_fn, backend = _generate_fn(args.backend, model_dir)
    start = time.perf_counter()
    report = evaluate(generate_fn, n=args.n, seed=args.seed, batch_size=args.batch_size)
    seconds = time.perf_counter() - start
    header = f"model {args.model or 'embedded'}, backend {backend}, held-out seed {args.seed}, {seconds:.0f} s"
    print(header)
    print(report.format())
    if args.record:
        command = f"python -m mm_serve.shapes eval --n {args.n} --seed {args.seed} --backend {backend}"
        _record(model_dir, f"`{command}` ({header}):\n\n```\n{report.format()}\n```")
    return 0


def _draw(args: argparse.Namespace) -> int:
    import random

    from mm_serve.shapes.scenes import MAX_SIDE, MIN_SIDE, draw_scene
    from mm_serve.shapes.targets import caption

    size = None
    if args.size is not None:
        width, height = args.size
        if not (MIN_SIDE <= width <= MAX_SIDE and MIN_SIDE <= height <= MAX_SIDE):
            print(f"error: --size sides must be in [{MIN_SIDE}, {MAX_SIDE}] px, got {width} x {height}", file=sys.stderr)
            return 2
        size = (width, height)
    image, objects = draw_scene(random.Random(f"mm-serve-shapes/draw/{args.seed}"), size=size, count=args.count)
    try:
        image.save(args.out)
    except (OSError, ValueError) as exc:
        print(f"error: cannot write {args.out}: {exc}", file=sys.stderr)
        return 2
    print(caption(objects))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``train`` / ``eval`` / ``draw`` argument parser."""
    parser = argparse.ArgumentParser(prog="python -m mm_serve.shapes", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train the shapes model from scratch")
    train.add_argument("--out", required=True, help="output checkpoint directory")
    train.add_argument("--seed", type=int, default=0, help="seed of weights and training scenes (default 0)")
    train.add_argument("--steps", type=int, default=None, help="stage 2 steps (default: the shipped recipe)")
    train.add_argument("--qa-steps", type=int, default=None, help="stage 3 (grounded QA) steps (default 0)")
    train.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    train.add_argument("--question-probe-weight", type=float, default=None,
                       help="weight of the question-probe loss in stages 2-3 (default: the shipped recipe's)")
    train.add_argument(
        "--start-stage",
        type=int,
        choices=(1, 3),
        default=1,
        help="1: from scratch (default); 3: run stage 3 on the checkpoint already in --out",
    )
    train.set_defaults(func=_train)
    ev = sub.add_parser("eval", help="score a checkpoint on held-out scenes")
    ev.add_argument("--model", default=None, help="checkpoint directory or name (default: embedded)")
    ev.add_argument("--n", type=int, default=500, help="held-out scenes (default 500)")
    ev.add_argument("--seed", type=int, default=0, help="held-out stream seed (namespace 'heldout')")
    ev.add_argument("--backend", choices=("hf", "mm_serve"), default="mm_serve", help="answering engine")
    ev.add_argument("--batch-size", type=int, default=64, help="questions per generate call")
    ev.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ev.add_argument("--record", action="store_true", help="write the figures into the model's TRAINING.md")
    ev.set_defaults(func=_eval)
    draw = sub.add_parser("draw", help="draw one scene to an image file and print its true caption")
    draw.add_argument("--out", default="scene.png", help="image file to write (default scene.png; format from the suffix)")
    draw.add_argument("--seed", type=int, default=0, help="scene seed (default 0)")
    draw.add_argument("--count", type=int, choices=(1, 2, 3), default=None, help="number of shapes (default: random)")
    draw.add_argument("--size", type=int, nargs=2, metavar=("W", "H"), default=None, help="image size in px (default: random)")
    draw.set_defaults(func=_draw)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the sub-command; returns the exit status."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
