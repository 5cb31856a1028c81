"""``mm-serve profile``: time our engine on this machine and write a planner profile file."""

from __future__ import annotations

import argparse
import json
import os
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
    import torch

    from mm_serve.colocated.llm_engine import LLMEngine
    from mm_serve.models.model_config import CheckpointError
    from mm_serve.models.named_models import resolve_model
    from mm_serve.planner.profiler import EngineProfiler
    from mm_serve.runtime.engine_config import EngineConfig

    prefill_tokens = _ints(args.prefill_tokens, "--prefill-tokens")
    batches = _ints(args.decode_batches, "--decode-batches")
    contexts = _ints(args.decode_contexts, "--decode-contexts")
    if args.threads < 1 or args.repeats < 1:
        raise CLIError("--threads and --repeats must be >= 1")
    try:
        model_dir = resolve_model(args.model)
    except CheckpointError as exc:
        raise CLIError(str(exc)) from None
    torch.set_num_threads(args.threads)
    need = max(max(prefill_tokens), max(batches) * (max(contexts) + 16))
    engine = LLMEngine(model_dir, EngineConfig(num_pages=need // 16 + 64))
    if max(prefill_tokens) + 1 > engine.max_model_len or max(contexts) + 1 > engine.max_model_len:
        raise CLIError(f"sizes exceed the model's context length ({engine.max_model_len} tokens)")
    prof = EngineProfiler(engine, args.repeats)
    rows: dict[str, list[dict[str, float]]] = {"prefill": [], "decode": [], "encode": []}
    for tokens in prefill_tokens:
        seconds = prof.prefill(tokens, 1)
        rows["prefill"].append({"tokens": tokens, "batch": 1, "seconds": seconds})
        print(f"prefill tokens={tokens:5d}              {seconds * 1000:9.2f} ms", flush=True)
    for batch in batches:
        for context in contexts:
            seconds = prof.decode(batch, context)
            rows["decode"].append({"batch": batch, "context": context, "seconds": seconds})
            print(f"decode  batch={batch:3d} context={context:5d} {seconds * 1000:9.2f} ms", flush=True)
    for images in (1, 4):
        seconds_or_none = prof.encode(images)
        if seconds_or_none is not None:
            rows["encode"].append({"images": images, "seconds": seconds_or_none})
            print(f"encode  images={images}                {seconds_or_none * 1000:9.2f} ms", flush=True)
    out = Path(args.out)
    profile = {
        "format": "mm-serve-profile/1", "name": f"cpu-{args.threads}thread",
        "device": f"{os.cpu_count()} CPU cores, {args.threads} torch thread(s), torch {torch.__version__}",
        "memory_bytes": 16 * 2**30, "model": str(Path(model_dir).resolve()), "dtype": engine.config.dtype, **rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2))
    print(f"wrote {out}")
    return 0
