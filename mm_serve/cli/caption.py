"""``mm-serve caption``: caption a folder, a JSONL file or an OpenAI batch file; resumable.

Without ``--server`` the job starts an in-process disaggregated engine (``--model``,
``--config``); with ``--server URL`` it sends the same requests to any
OpenAI-compatible server. Rows go to ``--out`` as each input finishes; re-running
the same command skips the ids already there. The guide is ``docs/caption.md``.

Exit status: 0 when every input has a row (error rows included), 1 when the
service went away or failed to start, 2 for a usage error, 130 (143) after
Ctrl-C (SIGTERM), with every finished row written.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mm_serve.cli.main import CLIError

if TYPE_CHECKING:
    from mm_serve.caption.backends import CaptionBackend
    from mm_serve.caption.engine_backend import EngineBackend
    from mm_serve.caption.inputs import CaptionInput, InputFormat
    from mm_serve.caption.output import OutputFile
    from mm_serve.caption.summary import JobStats

DEFAULT_PROMPT = "Describe the image."


def register(subparsers: Any) -> None:
    """Add the ``caption`` sub-command."""
    p = subparsers.add_parser(
        "caption", help="caption a folder / JSONL / OpenAI batch file of images (resumable)",
        description="Caption every image of INPUT into OUT (JSON lines), on an in-process engine or "
                    "--server. Re-running the same command resumes: ids already in OUT are skipped.",
    )
    p.add_argument("input", metavar="INPUT",
                   help="a folder (recursive: jpg jpeg png webp gif bmp tif tiff; mp4 webm mov mkv avi m4v for a "
                        'model that takes video), a JSONL file of {"id", "image" | "video", "prompt"?} rows, or an '
                        "OpenAI batch input file")
    p.add_argument("--out", required=True, metavar="OUT.jsonl", help="output JSON lines (appended to; resumed)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"the text after the image (default: {DEFAULT_PROMPT!r})")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--model", default=None, help="in-process engine: checkpoint directory or registered name "
                                                     "(default: the config's model, embedded)")
    where.add_argument("--server", default=None, metavar="URL", help="use this OpenAI-compatible server instead")
    p.add_argument("--config", default=None, help="in-process engine: YAML service config")
    p.add_argument("--served-model", default=None, metavar="NAME",
                   help="--server: the model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="--server: bearer key (default: $OPENAI_API_KEY)")
    p.add_argument("--retries", type=int, default=3, metavar="N",
                   help="--server: retries of a failed connection or a 429/502/503/504 answer (default 3)")
    p.add_argument("--concurrency", type=int, default=None, metavar="N",
                   help="inputs in flight (default: 2 x decode_max_concurrent x decode workers in-process, "
                        "32 with --server)")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N", help="new tokens per caption (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="caption sampling temperature (default 0: greedy)")
    p.add_argument("--in-order", action="store_true", help="write rows in input order (default: as each finishes)")
    p.add_argument("--retry-errors", action="store_true", help="re-run inputs whose row in OUT is an error")
    p.add_argument("--max-image-pixels", type=int, default=None, metavar="N",
                   help="refuse larger images (default: api.max_image_pixels, 40000000)")
    p.add_argument("--fsync", action="store_true", help="fsync OUT after every row (survives power loss; slower)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _check_args(args: argparse.Namespace) -> None:
    if args.concurrency is not None and args.concurrency < 1:
        raise CLIError(f"--concurrency must be at least 1, got {args.concurrency}")
    if args.max_tokens < 1:
        raise CLIError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if not 0.0 <= args.temperature <= 2.0:
        raise CLIError(f"--temperature must be in [0, 2], got {args.temperature}")
    if args.max_image_pixels is not None and args.max_image_pixels < 1:
        raise CLIError(f"--max-image-pixels must be positive, got {args.max_image_pixels}")
    if args.server and args.config:
        raise CLIError("--config configures the in-process engine; it cannot be used with --server")
    if args.server:
        from urllib.parse import urlparse

        parsed = urlparse(args.server)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise CLIError(f"--server must be an http(s) URL such as http://127.0.0.1:8000, got {args.server!r}")
    if args.retries < 0:
        raise CLIError(f"--retries must be 0 or more, got {args.retries}")
    if not args.server and (args.served_model or args.api_key):
        raise CLIError("--served-model and --api-key only apply with --server")
    out, source = Path(args.out), Path(args.input)
    if out.exists() and source.is_file() and out.resolve() == source.resolve():
        raise CLIError("--out is the INPUT file; choose another path")


def run(args: argparse.Namespace) -> int:
    """Read INPUT, resume OUT, start the backend, run the job, print the summary."""
    from mm_serve.caption.inputs import InputError, read_inputs
    from mm_serve.caption.output import OutputError, OutputFile

    _check_args(args)
    created = not os.path.lexists(args.out)  # (a dangling symlink is the user's, not ours)
    try:
        inputs = read_inputs(args.input, args.prompt)
        out, resume = OutputFile.open(args.out, inputs.format, retry_errors=args.retry_errors, fsync=args.fsync)
    except (InputError, OutputError) as exc:
        raise CLIError(str(exc)) from None
    from mm_serve.caption.backends import FatalBackendError
    from mm_serve.engine.engine_client import WorkerStartError

    try:
        if resume.repaired_tail:
            print(f"mm-serve caption: cut a partial last line from {args.out} (an interrupted write)", file=sys.stderr)
        if resume.dropped_errors:
            print(f"mm-serve caption: retrying {resume.dropped_errors} input(s) with error rows", file=sys.stderr)
        todo = [item for item in inputs.items if item.id not in resume.done]
        skipped = len(inputs.items) - len(todo)
        received: list[int] = []  # the signal that stopped the job, if one did
        stats = _run_job(args, inputs.format, todo, skipped, out, received)
    except WorkerStartError as exc:
        print(f"mm-serve: error: the engine failed to start: {exc}", file=sys.stderr)
        return 1
    except FatalBackendError as exc:  # only raised while connecting, before any input ran
        print(f"mm-serve: error: --server {args.server}: {exc}", file=sys.stderr)
        return 1
    finally:
        if created:
            _remove_if_unused(Path(args.out))  # still holding OUT's lock: no other job can be writing it
        out.close()
    print(stats.format(), flush=True)
    if stats.interrupted:
        return 128 + (received[0] if received else int(signal.SIGINT))
    if stats.failed and not stats.succeeded:  # every input run failed: a script must not read that as done
        print(f"mm-serve caption: every input of this run failed ({stats.failed}); see the error rows in {args.out}",
              file=sys.stderr)
        return 1
    return 1 if stats.fatal_error else 0


def _remove_if_unused(path: Path) -> None:
    """Delete OUT, which this run created, when nothing was written (the job failed before any input ran).

    Called while this job still holds OUT's lock, so no other job is writing it.
    """
    try:
        if not path.is_symlink() and path.stat().st_size == 0:
            path.unlink()
    except OSError:
        pass


def _run_job(args: argparse.Namespace, fmt: InputFormat, todo: list[CaptionInput], skipped: int,
             out: OutputFile, received: list[int]) -> JobStats:
    from mm_serve.caption.summary import JobStats

    if not todo:
        return JobStats(total=skipped, skipped=skipped)
    engine = None if args.server else _start_engine(args)
    try:
        return asyncio.run(_run_async(args, fmt, todo, skipped, out, engine, received))
    finally:
        if engine is not None:
            engine.close()


def _start_engine(args: argparse.Namespace) -> EngineBackend:
    """Start the in-process engine (blocks until its workers are ready).

    Raises:
        CLIError: a bad config or model.
        WorkerStartError: a worker failed to start.
    """
    from mm_serve.caption.engine_backend import EngineBackend
    from mm_serve.config import ConfigError, load_config
    from mm_serve.models.model_config import CheckpointError
    from mm_serve.models.named_models import resolve_model

    overrides: dict[str, Any] = {"model": args.model} if args.model else {}
    if args.max_image_pixels:
        overrides["api.max_image_pixels"] = args.max_image_pixels
    try:
        cfg = load_config(args.config, overrides)
        for line in cfg.ineffective_settings():
            print(f"mm-serve caption: warning: {line}", file=sys.stderr, flush=True)
        model_dir = resolve_model(cfg.model)
        print(f"mm-serve caption: starting the {cfg.mode} engine for {model_dir} ...", file=sys.stderr, flush=True)
        return EngineBackend.start(model_dir, cfg, max_tokens=args.max_tokens, temperature=args.temperature,
                                   model_name=cfg.served_model_name or str(cfg.model))
    except (ConfigError, CheckpointError) as exc:
        raise CLIError(str(exc)) from None


async def _run_async(args: argparse.Namespace, fmt: InputFormat, todo: list[CaptionInput], skipped: int,
                     out: OutputFile, engine: EngineBackend | None, received: list[int]) -> JobStats:
    from mm_serve.caption.runner import CaptionJob

    backend: CaptionBackend = engine if engine is not None else await _open_server(args)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        received.append(signum)
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        job = CaptionJob(todo, fmt, backend, out, concurrency=args.concurrency or backend.default_concurrency,
                         in_order=args.in_order, skipped=skipped, show_progress=not args.no_progress)
        return await job.run(stop)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        if engine is None:
            await backend.aclose()


async def _open_server(args: argparse.Namespace) -> CaptionBackend:
    from mm_serve.caption.backends import DEFAULT_MAX_IMAGE_PIXELS
    from mm_serve.caption.server_backend import ServerBackend

    backend = ServerBackend(
        args.server, model=args.served_model, api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        max_tokens=args.max_tokens, temperature=args.temperature,
        max_pixels=args.max_image_pixels or DEFAULT_MAX_IMAGE_PIXELS, concurrency=args.concurrency or 32,
        retries=args.retries,
    )
    try:
        await backend.start()
    except BaseException:
        await backend.aclose()
        raise
    return backend
