"""``mm-serve profile``: time our engine on this machine and write a planner profile file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mm_serve.cli.main import CLIError


def register(subparsers: Any) -> None:
    """Add the ``profile`` sub-command."""
    p = subparsers.add_parser(
        "profile", help="measure prefill/decode/encode times here and write a planner profile",
        description="Time forward passes of our engine at a few sizes and write a profile JSON "
                    "that `mm-serve plan --hardware PROFILE.json` fits (docs/planner.md).",
    )
    p.add_argument("--model", default=None, help="checkpoint directory or registered name (default: embedded)")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--threads", type=int, default=1, help="torch threads (one core per worker by default)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-tokens", default="32,128,512,1024")
    p.add_argument("--decode-batches", default="1,4,16,32")
    p.add_argument("--decode-contexts", default="128,512")
    p.add_argument("--parallel-threads", default="", metavar="N,...",
                   help="with --threads 1, also time every size on each of these thread counts: the planner "
                        "prices an instance of N cores from them (a tensor_parallel entry of degree N)")
    p.set_defaults(func=run)


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CLIError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise CLIError(f"{flag} needs positive integers, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    """Measure and write the profile; prints each point as it goes."""
    from mm_serve.models.model_config import CheckpointError
    from mm_serve.models.named_models import resolve_model
    from mm_serve.planner.auto_placement import usable_cores
    from mm_serve.planner.profiler import measure_profile

    prefill_tokens = _ints(args.prefill_tokens, "--prefill-tokens")
    batches = _ints(args.decode_batches, "--decode-batches")
    contexts = _ints(args.decode_contexts, "--decode-contexts")
    parallel = _ints(args.parallel_threads, "--parallel-threads") if args.parallel_threads.strip() else []
    if args.threads < 1 or args.repeats < 1:
        raise CLIError("--threads and --repeats must be >= 1")
    if parallel and args.threads != 1:
        raise CLIError(f"--parallel-threads needs --threads 1 (each count is an instance of that many cores), "
                       f"got --threads {args.threads}")
    cores = len(usable_cores())
    if parallel and not 2 <= min(parallel) <= max(parallel) <= cores:
        raise CLIError(f"--parallel-threads counts must be between 2 and the {cores} usable cores, "
                       f"got {args.parallel_threads!r}")
    try:
        model_dir = resolve_model(args.model)
    except CheckpointError as exc:
        raise CLIError(str(exc)) from None
    limit = _context_limit(model_dir)
    if max(prefill_tokens) + 1 > limit or max(contexts) + 1 > limit:
        raise CLIError(f"sizes exceed the model's context length ({limit} tokens)")
    profile = measure_profile(model_dir, args.threads, args.repeats, prefill_tokens, batches, contexts,
                              log=lambda line: print(line, flush=True), parallel_threads=parallel)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2))
    print(f"wrote {out}")
    return 0


def _context_limit(model_dir: Path) -> int:
    """The context length of the checkpoint at ``model_dir`` in tokens (what the engine allows)."""
    from mm_serve.models.registry import load_model_config
    from mm_serve.runtime.engine_config import EngineConfig

    return EngineConfig().context_limit(load_model_config(model_dir).text)
