"""``mm-serve bench``: goodput benchmark client for any OpenAI-compatible server.

Examples::

    # our server, both modes on the same cores, goodput of each and the ratio
    mm-serve bench --config configs/default.yaml --model out/bench-llava --workload llava --sweep \
        --slo-ttft 1 --slo-tpot 0.05 --compare colocated --out bench_out/llava
    # any running server (vLLM, transformers serve, mm-serve), one rate
    mm-serve bench --server http://127.0.0.1:8000 --model DIR --workload llava --rate 2 --slo-ttft 1 --slo-tpot 0.05
    # three alternating sweeps of each mode: median goodput and range
    mm-serve bench --config configs/default.yaml --model out/bench-llama --workload summarization --sweep \
        --compare colocated --repeat 3 --out bench_out/summarization
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mm_serve.cli.main import CLIError, stop_on_signal

if TYPE_CHECKING:
    from mm_serve.bench.report import SystemResult
    from mm_serve.bench.session import BenchSettings
    from mm_serve.config import SLOConfig
    from mm_serve.ground.slo import SLO


CHAT_TEMPLATE_TOKENS = 32  # context left for the chat template's tokens when prompts are fitted to it
COMPLETION_EXTRA_TOKENS = 4  # the same for a plain prompt: the tokenizer's BOS, and slack for re-tokenizing


def register(subparsers: Any) -> None:
    """Add the ``bench`` sub-command."""
    p = subparsers.add_parser(
        "bench", help="measure SLO attainment and goodput of a server under a workload",
        description="Open-loop load (Poisson or gamma arrivals) against an OpenAI-compatible server: "
        "TTFT, TPOT, ITL, e2e percentiles, SLO attainment, throughput, and goodput by rate search.",
    )
    target = p.add_mutually_exclusive_group()
    target.add_argument("--server", metavar="URL", help="a running OpenAI-compatible server")
    target.add_argument("--config", metavar="FILE", help="start our server with this config (default: defaults)")
    p.add_argument("--model", metavar="DIR", help="checkpoint: served with --config; with --server, read "
                   "locally for the tokenizer (exact prompt lengths) and the image size")
    p.add_argument("--model-name", help="model id to send (default: the first of GET /v1/models)")
    p.add_argument("--workload", default="chatbot",
                   help="chatbot (ShareGPT-like), code (HumanEval-like), summarization (LongBench-like: "
                   "long documents, short summaries), llava, long-multimodal (2-4 images and a long document), "
                   "caption, multiturn-llava (5-turn image chat, each turn sent after "
                   "the previous answer with the whole history), shared-prompt (one 400-token system prompt), "
                   "caption-repeat (each image 3 times), short-video (a 2 s clip and a question, for a model "
                   "that takes video), or a JSONL file (conversation_id/turn for multi-turn traffic); rates are "
                   "requests/s for every workload")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, metavar="R", help="one run at R requests/s")
    load.add_argument("--sweep", action="store_true", help="find the goodput by searching the rate")
    p.add_argument("--slo-ttft", type=float, metavar="S", help="TTFT SLO, s (default 5x unloaded p90)")
    p.add_argument("--slo-tpot", type=float, metavar="S", help="TPOT SLO, s (default 5x unloaded p90)")
    p.add_argument("--attainment", type=float, default=0.9, help="goodput attainment target (default 0.9)")
    p.add_argument("--duration", type=float, default=60.0, metavar="S", help="seconds of arrivals per run")
    p.add_argument("--num-requests", type=int, metavar="N",
                   help="requests per run (overrides --duration, except that a run never plans "
                   "arrivals past 3x --duration)")
    p.add_argument("--burstiness", type=float, default=1.0, metavar="CV",
                   help="gamma arrivals with this gap CV (1 = Poisson, > 1 burstier)")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    p.add_argument("--compare", choices=["colocated"], help="also run our colocated mode on the same cores")
    p.add_argument("--start-rate", type=float, metavar="R", help="first sweep rate (default from unloaded e2e)")
    p.add_argument("--no-admission", action="store_true",
                   help="start our servers with --no-admission: no refusals by latency prediction (a refusal "
                   "counts as a miss), for goodput comparisons of placements and modes")
    p.add_argument("--repeat", type=int, default=1, metavar="K",
                   help="with --sweep: run every system's sweep K times, alternating systems (our servers "
                   "restarted each round; other text and images each round), and report the median goodput "
                   "with its range (default 1)")
    p.add_argument("--rate-tolerance", type=float, default=0.1, help="sweep precision, relative (default 0.1)")
    p.add_argument("--api", choices=["chat", "completions"], default="chat")
    p.add_argument("--api-key", help="bearer key for the server")
    p.add_argument("--label", help="name of the --server system in reports (default: server)")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (for strict servers)")
    p.add_argument("--no-early-stop", action="store_true", help="finish every run even when it has failed")
    p.add_argument("--tier-mix", metavar="MIX",
                   help="send service_tier per request, e.g. interactive=0.3,standard=0.5,batch=0.2, and report "
                        "per tier the refusals, the attainment of the admitted (tiers' SLOs from --config, else "
                        "the defaults) and their goodput")
    p.add_argument("--out", metavar="DIR", help="write bench.json, attainment.png, records-*.jsonl and server logs here")
    p.set_defaults(func=run)


MAX_NUMBER = 1e9  # bound of every rate, SLO and duration flag (1e308 requests/s overflowed the request count)


def _check(args: argparse.Namespace) -> None:
    for name in ("rate", "slo_ttft", "slo_tpot", "duration", "start_rate", "rate_tolerance", "burstiness"):
        value = getattr(args, name)
        if value is not None and not 0 < value < MAX_NUMBER:  # NaN and inf too
            raise CLIError(f"--{name.replace('_', '-')} must be > 0 and < {MAX_NUMBER:g}, got {value}")
    if not 0 < args.attainment <= 1:
        raise CLIError(f"--attainment must be in (0, 1], got {args.attainment}")
    if args.repeat < 1:
        raise CLIError(f"--repeat must be >= 1, got {args.repeat}")
    if args.repeat > 1 and not args.sweep:
        raise CLIError("--repeat repeats goodput searches: use it with --sweep")
    if args.num_requests is not None and args.num_requests < 1:
        raise CLIError(f"--num-requests must be >= 1, got {args.num_requests}")
    if (args.slo_ttft is None) != (args.slo_tpot is None):
        raise CLIError("give both --slo-ttft and --slo-tpot, or neither (then 5x the unloaded p90s)")
    if args.server and args.no_admission:
        raise CLIError("--no-admission applies to the servers mm-serve bench starts; start yours with it instead")
    if args.server and args.compare:
        raise CLIError("--compare starts our own servers; use --config (or neither), not --server")
    if args.model and not args.server:
        from mm_serve.models.named_models import NAMED_MODELS

        if args.model not in NAMED_MODELS and not Path(args.model).is_dir():
            raise CLIError(f"--model {args.model} is not a directory or a registered name "
                           f"({', '.join(sorted(NAMED_MODELS))})")


def _model_dir(args: argparse.Namespace) -> tuple[Path | None, str]:
    """The local checkpoint directory (if any) and the mode our server will start in (``auto``: the
    config pins no placement, so ``mm-serve serve`` lets the planner choose)."""
    from mm_serve.config import ConfigError, load_config
    from mm_serve.models.named_models import resolve_model
    from mm_serve.planner.auto_placement import pinned_keys

    try:
        if args.server:
            return (resolve_model(args.model) if args.model else _served_checkpoint(args)), ""
        cfg = load_config(args.config, {"model": args.model} if args.model else None)
        return resolve_model(cfg.model), ("auto" if cfg.placement.auto and not pinned_keys(cfg) else cfg.mode)
    except (ConfigError, ValueError, OSError) as exc:
        raise CLIError(str(exc)) from None


def _served_checkpoint(args: argparse.Namespace) -> Path | None:
    """The checkpoint ``--server`` serves when this machine can resolve its model id (a registered name such
    as ``embedded``, or a checkpoint path): its tokenizer sizes the prompts exactly (without one, text is
    sized at about 4 characters a token: 747 tokens for a 512-token budget on the embedded tokenizer). None
    otherwise."""
    from mm_serve.bench.session import served_model_id
    from mm_serve.models.model_config import CheckpointError
    from mm_serve.models.named_models import resolve_model

    try:
        return resolve_model(served_model_id(args.server, args.api_key))
    except (ConnectionError, CheckpointError, ValueError, OSError):
        return None


def served_placement_name(url: str, name: str) -> str:
    """The name of our server in reports, from ``/health``'s ``placement``: ``auto-<choice>``
    (``auto-colocated``, ``auto-1P+1D``) when the planner or the one-core rule chose it at start;
    when the config's placement runs, ``name`` (the config's mode), or for ``name`` ``auto`` (no
    placement keys, but the planner could not plan) the mode it fell back to."""
    import httpx

    try:
        placement = httpx.get(f"{url}/health", timeout=10).json().get("placement") or {}
    except (httpx.HTTPError, ValueError):
        return name
    if placement.get("source") in ("planner", "rule"):
        return f"auto-{placement['chosen']}"
    return str(placement.get("mode", name)) if name == "auto" else name


def _settings(args: argparse.Namespace, model_dir: Path | None) -> BenchSettings:
    from mm_serve.bench.requests import image_shapes, video_shapes, video_tokens
    from mm_serve.bench.runner import LoadSpec
    from mm_serve.bench.session import BenchSettings
    from mm_serve.models.model_config import CheckpointError
    from mm_serve.models.registry import load_model_config
    from mm_serve.workloads import (
        IMAGE_WORKLOADS,
        VIDEO_WORKLOADS,
        WorkloadError,
        is_conversational,
        make_workload,
    )

    image_tokens, image_size, max_context, tokens_per_video = 0, 336, 4096, 0
    shapes: tuple[tuple[int, int], ...] = ()
    frames: tuple[tuple[int, int], ...] = ((224, 224),)
    if model_dir is not None:
        try:
            shape = load_model_config(model_dir)
        except CheckpointError as exc:
            raise CLIError(str(exc)) from None
        max_context = shape.text.max_position_embeddings
        if shape.vision is not None:
            # a tiling family: images of mixed shapes, the text fitted around the most tokens one can make
            image_tokens, image_size = shape.vision.max_image_tokens, shape.vision.image_size
            if shape.vision.any_resolution or shape.vision.dynamic_resolution:
                shapes = tuple(image_shapes(shape.vision))
            if shape.vision.video_token_index is not None:  # a family that takes video: short clips of mixed sizes
                frames, tokens_per_video = tuple(video_shapes(shape.vision)), video_tokens(shape.vision)
    if model_dir is None and args.server:  # prompts fitted to the served model's context, as it lists it
        from mm_serve.bench.session import served_context

        with contextlib.suppress(ConnectionError):  # said when the run lists the models
            max_context = served_context(args.server, args.api_key) or max_context
    try:
        if (args.workload in IMAGE_WORKLOADS or args.workload in VIDEO_WORKLOADS) and model_dir is None:
            raise WorkloadError(f"workload '{args.workload}' with --server needs --model DIR (image size)")
        # a chat template adds its own tokens around the text (6-30 on the families served), a plain prompt
        # its BOS: room for them
        room = max_context - (CHAT_TEMPLATE_TOKENS if args.api == "chat" else COMPLETION_EXTRA_TOKENS)
        workload = make_workload(args.workload, image_tokens, room, tokens_per_video)
        load = LoadSpec(workload, args.seed, args.duration, args.num_requests, burstiness=args.burstiness)
    except WorkloadError as exc:
        raise CLIError(str(exc)) from None
    if args.api == "completions" and (args.workload in IMAGE_WORKLOADS or args.workload in VIDEO_WORKLOADS
                                      or is_conversational(workload)):
        raise CLIError("image, video and conversation workloads need --api chat")
    tier_mix, tier_slo = _tier_settings(args)
    return BenchSettings(
        load=load, target=args.attainment, rate=args.rate, sweep=args.sweep, start_rate=args.start_rate,
        rel_tol=args.rate_tolerance, api=args.api, api_key=args.api_key, tokenizer_dir=model_dir,
        image_size=shapes or image_size, video_shapes=frames, ignore_eos=not args.no_ignore_eos, early_stop=not args.no_early_stop,
        records_dir=Path(args.out) if args.out else None, tier_mix=tier_mix, tier_slo=tier_slo,
    )


def _tier_settings(args: argparse.Namespace) -> tuple[dict[str, float] | None, SLOConfig]:
    """``--tier-mix`` parsed, and the tiers' SLOs (of ``--config``, else the defaults)."""
    from mm_serve.bench.tier_report import parse_tier_mix
    from mm_serve.config import ConfigError, SLOConfig, load_config

    if not args.tier_mix:
        return None, SLOConfig()
    try:
        mix = parse_tier_mix(args.tier_mix)
        slo = load_config(args.config).slo if getattr(args, "config", None) else SLOConfig()
    except (ValueError, ConfigError) as exc:
        raise CLIError(str(exc)) from None
    return mix, slo


def _log(line: str) -> None:
    print(line, flush=True)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; SIGTERM, and SIGINT even where a background shell ignores it, raise
    StopSignal (a KeyboardInterrupt), so that the servers this command started are stopped on the way out."""
    previous = {sig: signal.signal(sig, stop_on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _run(args)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _write(out: Path, results: list[SystemResult], slo: SLO, settings: BenchSettings,
           args: argparse.Namespace) -> None:
    """Write bench.json and attainment.png for the systems measured so far."""
    from mm_serve.bench.plot import curves_from_json, plot_attainment
    from mm_serve.bench.report import write_json

    write_json(out / "bench.json", results, slo, settings.target,
               {k: v for k, v in vars(args).items() if k not in ("func", "api_key")})
    doc = json.loads((out / "bench.json").read_text())
    try:
        plot_attainment(curves_from_json(doc), settings.target, out / "attainment.png",
                        f"{args.workload}: TTFT {slo.ttft_s:g} s, TPOT {slo.tpot_s * 1e3:g} ms")
    except (OSError, ValueError) as exc:  # the figure only: bench.json and the records are written
        print(f"mm-serve bench: warning: no attainment.png ({exc})", file=sys.stderr, flush=True)


def _start_rate(results: list[SystemResult], name: str) -> float | None:
    """First sweep rate, requests/s: the system's round-1 goodput (every later round searches from
    the same rate, so one round's result does not steer the next), else the first system's; None at first."""
    own = [r.sweep.goodput for r in results if r.name == name and r.round == 1 and r.sweep is not None]
    if own and own[0] > 0:
        return own[0]
    first = results[0].sweep.goodput if results and results[0].sweep else None
    return first or None


def _run(args: argparse.Namespace) -> int:
    """Measure each system in turn (starting our servers when asked), print and write the results."""
    from mm_serve.bench.launch import LaunchError, LocalServer, wait_while_warming
    from mm_serve.bench.report import format_goodput, format_runs
    from mm_serve.bench.session import measure
    from mm_serve.ground.slo import SLO

    _check(args)
    out = Path(args.out) if args.out else None
    if out is not None:  # before any request is sent: the figures are written at the end
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CLIError(f"--out {args.out}: cannot create it ({exc.strerror})") from None
        if not os.access(out, os.W_OK):
            raise CLIError(f"--out {args.out}: not writable")
    model_dir, mode = _model_dir(args)
    settings = _settings(args, model_dir)
    if out is not None:  # the run is valid: its records replace an earlier run's (not appended to them)
        for stale in (*out.glob("records-*.jsonl"), *out.glob("round-*/records-*.jsonl")):
            stale.unlink()
    slo = SLO(args.slo_ttft, args.slo_tpot) if args.slo_ttft else None
    # the logs of the servers this command starts: in --out, else in a temporary folder kept for reading
    logs = out or (None if args.server else Path(tempfile.mkdtemp(prefix="mm-serve-bench-")))
    systems: list[tuple[str, str | None]] = [(args.label or "server", None)] if args.server else [(mode, None)]
    if args.compare == "colocated":
        if mode == "colocated":
            raise CLIError("the config already runs colocated; --compare colocated needs a disaggregated config")
        systems.append(("colocated", "colocated"))
    results: list[SystemResult] = []
    for round_ in range(1, args.repeat + 1):
        round_settings = settings if args.repeat == 1 else replace(  # other content each round: no cache carries over
            settings, load=replace(settings.load, content_salt=round_ - 1),
            records_dir=settings.records_dir / f"round-{round_}" if settings.records_dir else None)
        for name, mode_override in systems:
            label = name if args.repeat == 1 else f"{name}-{round_}"
            server = None if logs is None else LocalServer(
                logs / f"server-{label}.log", args.config, args.model, mode_override,
                extra_args=("--no-admission",) if args.no_admission else ())
            if args.repeat > 1:
                _log(f"[{name}] round {round_} of {args.repeat}")
            try:
                if args.server and round_ == 1:
                    wait_while_warming(args.server, api_key=settings.api_key, log=_log)
                url = args.server or (server.start() if server else "")
                shown = name if args.server else served_placement_name(url, name)
                result, slo = measure(shown, url, round_settings, slo, args.model_name,
                                      _start_rate(results, shown), _log)
            except LaunchError as exc:
                print(f"mm-serve: error: {exc}", file=sys.stderr)
                return 1
            except (ConnectionError, ValueError) as exc:
                raise CLIError(str(exc)) from None
            finally:
                if server is not None:
                    server.stop()
            results.append(replace(result, round=round_))
            if out is not None:
                _write(out, results, slo, settings, args)
    print()
    for result in results:
        print((f"round {result.round}: " if args.repeat > 1 else "") + format_runs(result) + "\n")
    if slo is not None and settings.sweep:
        print(format_goodput(results, slo, settings.target))
    if out is not None:
        print(f"\nwrote {out / 'bench.json'} and {out / 'attainment.png'}")
    elif logs is not None:
        print(f"\nserver logs: {logs}")
    return _all_failed(results)


def _all_failed(results: list[SystemResult]) -> int:
    """1 (and the most common error on stderr) when no request of any run succeeded, else 0."""
    runs = [run for result in results for run in (result.unloaded, *result.runs)]
    if any(run.num_ok for run in runs):
        return 0
    errors: dict[str, int] = {}
    for run in runs:
        for message, count in run.errors.items():
            errors[message] = errors.get(message, 0) + count
    worst = max(errors.items(), key=lambda kv: kv[1], default=("no request was sent", 0))
    print(f"mm-serve: error: no request succeeded (e.g. {worst[0]!r} x{worst[1]})", file=sys.stderr)
    return 1
