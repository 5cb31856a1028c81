"""``mm-serve profile``: time our engine on this machine and write a planner profile file."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mm_serve.cli.main import CLIError

DEFAULT_PREFILL_TOKENS = (32, 128, 512, 1024)
DEFAULT_DECODE_CONTEXTS = (128, 512)
"""The sizes timed when the flags are not given; those past the model's context are capped to it."""


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
    p.add_argument("--repeats", type=int, default=3, help="timed passes per size, the median kept (default 3)")
    p.add_argument("--prefill-tokens", default=None, metavar="N,...",
                   help=f"prompt lengths to time (default: {_join(DEFAULT_PREFILL_TOKENS)}, the ones past the "
                        "model's context replaced by the longest that fits)")
    p.add_argument("--decode-batches", default="1,4,16,32", metavar="N,...",
                   help="decode steps' batch sizes (default 1,4,16,32)")
    p.add_argument("--decode-contexts", default=None, metavar="N,...",
                   help=f"context lengths to time decode steps at (default: {_join(DEFAULT_DECODE_CONTEXTS)}, "
                        "capped to the model's context as --prefill-tokens)")
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
    from mm_serve.planner.auto_placement import (
        BUSY_SHARE_LIMIT,
        measure_watching_load,
        usable_cores,
    )
    from mm_serve.planner.profiler import measure_profile

    prefill_tokens = _ints(args.prefill_tokens, "--prefill-tokens") if args.prefill_tokens is not None else None
    batches = _ints(args.decode_batches, "--decode-batches")
    contexts = _ints(args.decode_contexts, "--decode-contexts") if args.decode_contexts is not None else None
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
    out = _writable(Path(args.out))  # before minutes of measuring
    try:
        model_dir = resolve_model(args.model)
        limit = _context_limit(model_dir)
        prefill_tokens, contexts = _fit_sizes(prefill_tokens, contexts, limit)
        profile, share = measure_watching_load(lambda: measure_profile(
            model_dir, args.threads, args.repeats, prefill_tokens, batches, contexts,
            log=lambda line: print(line, flush=True), parallel_threads=parallel))
    except CheckpointError as exc:  # an unsupported family, no weights, a broken config.json
        raise CLIError(str(exc)) from None
    if share is not None:
        print(f"mm-serve profile: warning: other processes kept {share:.0%} of this process's cores busy "
              f"while it measured (over {BUSY_SHARE_LIMIT:.0%}): the times are slower than this machine's; "
              "measure again when it is idle", file=sys.stderr, flush=True)
    try:
        out.write_text(json.dumps(profile, indent=2))
    except OSError as exc:
        raise CLIError(f"--out {out}: cannot write it ({exc.strerror or exc})") from None
    print(f"wrote {out}")
    return 0


def _writable(out: Path) -> Path:
    """``out``, its folder created; a folder, or a place no file can be written, is a :class:`CLIError` now."""
    if out.is_dir():
        raise CLIError(f"--out {out}: is a folder; give the profile's file name")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CLIError(f"--out {out}: cannot create its folder ({exc.strerror or exc})") from None
    existed = out.exists()
    try:  # opened for appending, as the write will be (os.access says yes to root, even on /proc)
        with open(out, "a"):
            pass
    except OSError as exc:
        raise CLIError(f"--out {out}: not writable ({exc.strerror or exc})") from None
    finally:
        if not existed:
            out.unlink(missing_ok=True)  # nothing half-made is left if the measuring is stopped
    return out


def _join(sizes: tuple[int, ...] | list[int]) -> str:
    return ",".join(str(v) for v in sizes)


def _fit_sizes(prefill_tokens: list[int] | None, contexts: list[int] | None, limit: int) -> tuple[list[int], list[int]]:
    """The prefill sizes and decode contexts to time on a model of ``limit`` context tokens (a prompt
    or context must leave room for one more token, so sizes go up to ``limit - 1``). Sizes the user
    gave (not None) that do not fit are an error naming the flag; in place of the defaults past it
    (``None``), the largest size that fits is timed once, so the points still reach the model's
    context, with a one-line note on stderr.

    Raises:
        CLIError: a given size does not fit, or the model's context leaves no size at all.
    """
    largest = limit - 1
    if largest < 1:
        raise CLIError(f"the model's context length ({limit} tokens) leaves no size to profile")
    fitted: list[list[int]] = []
    capped: list[str] = []
    for given, default, flag in ((prefill_tokens, DEFAULT_PREFILL_TOKENS, "--prefill-tokens"),
                                 (contexts, DEFAULT_DECODE_CONTEXTS, "--decode-contexts")):
        if given is not None:
            over = [v for v in given if v > largest]
            if over:
                raise CLIError(f"sizes exceed the model's context length ({limit} tokens): {flag} {_join(over)} "
                               f"(at most {largest}, one token stays for the next step)")
            fitted.append(given)
            continue
        kept = [v for v in default if v <= largest]
        over = [v for v in default if v > largest]
        if over:
            kept.append(largest)
            capped.append(f"{flag} {_join(over)} -> {largest}")
        fitted.append(kept)
    if capped:
        print(f"mm-serve profile: the model's context is {limit} tokens: default {'; '.join(capped)}",
              file=sys.stderr, flush=True)
    return fitted[0], fitted[1]


def _context_limit(model_dir: Path) -> int:
    """The context length of the checkpoint at ``model_dir`` in tokens (what the engine allows)."""
    from mm_serve.models.registry import load_model_config
    from mm_serve.runtime.engine_config import EngineConfig

    return EngineConfig().context_limit(load_model_config(model_dir).text)
