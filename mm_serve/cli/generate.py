"""``mm-serve generate``: run one prompt (optionally with images) through the offline engine."""

from __future__ import annotations

import argparse
from typing import Any

from mm_serve.cli.main import CLIError


def register(subparsers: Any) -> None:
    """Add the ``generate`` sub-command."""
    parser = subparsers.add_parser(
        "generate", help="generate text for one prompt offline (no server)",
        description="Generate for one chat prompt (and images) with the offline engine; prints the answer.",
    )
    parser.add_argument("--model", default=None, help="checkpoint directory or registered name (default: embedded)")
    parser.add_argument("--prompt", default="Describe the image.",
                        help="the user message (default: 'Describe the image.', asked when none is given)")
    parser.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most (default 32)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: none, a fresh draw)")
    parser.add_argument("--mode", choices=["colocated", "disaggregated"], default="colocated",
                        help="one worker for both phases, or prefill and decode workers (default colocated)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load the model, render the chat prompt, generate, print the text."""
    from mm_serve.inputs.input_processor import InvalidRequestError
    from mm_serve.media.errors import ImageError
    from mm_serve.media.image_loading import load_image_file
    from mm_serve.models.model_config import CheckpointError
    from mm_serve.offline.llm import LLM
    from mm_serve.runtime.sampling_params import SamplingParams

    try:
        images = [load_image_file(path, max_pixels=40_000_000) for path in args.image]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        llm = LLM(model=args.model, mode=args.mode)
        content: list[dict[str, Any]] = [{"type": "image", "image": img} for img in images]
        content.append({"type": "text", "text": args.prompt})
        out = llm.generate({"messages": [{"role": "user", "content": content}]}, params)[0]
    except (OSError, ImageError, CheckpointError, InvalidRequestError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    print(out.text.strip())
    return 0
