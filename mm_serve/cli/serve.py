"""``mm-serve serve``: the OpenAI-compatible server with its prefill/decode (or colocated) workers."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from mm_serve.cli.main import CLIError, StopSignal
from mm_serve.ground.console import say


def register(subparsers: Any) -> None:
    """Add the ``serve`` sub-command."""
    p = subparsers.add_parser(
        "serve", help="start the OpenAI-compatible API server and its workers",
        description="Serve a llava-hf or Llama checkpoint over an OpenAI-compatible HTTP API.",
    )
    p.add_argument("--config", default=None, help="YAML config file (see configs/default.yaml)")
    p.add_argument("--model", default=None, help="checkpoint directory or registered name (default: embedded)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the --model value)")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000)")
    p.add_argument("--mode", choices=["disaggregated", "colocated"], default=None,
                   help="prefill and decode in worker processes of their own, or one worker doing both (mode; "
                        "default: the planner's choice, else disaggregated)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
                   help="weights, KV cache, ring pages and features (dtype; default auto: the checkpoint's own "
                        "on a GPU, float32 on a CPU)")
    p.add_argument("--attention-backend", choices=["auto", "flex", "torch"], default=None,
                   help="attention over the KV pages (attention_backend; docs/attention.md)")
    p.add_argument("--prefill-workers", type=int, default=None, metavar="N",
                   help="prefill worker processes in disaggregated mode (compute.prefill_workers)")
    p.add_argument("--decode-workers", type=int, default=None, metavar="M",
                   help="decode worker processes in disaggregated mode (compute.decode_workers)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (api.api_key); give it once per tenant to accept several")
    p.add_argument("--cache-salt-by-api-key", action="store_true", default=None,
                   help="one tenant per API key: no prefix- or encoder-cache entry is shared across keys "
                        "(api.cache_salt_by_api_key)")
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR", help="allow file:// images and videos under DIR")
    p.add_argument("--allowed-media-domains", nargs="*", default=None, metavar="DOMAIN",
                   help="only fetch http(s) images and videos from these hosts")
    p.add_argument("--shutdown-grace-s", type=float, default=None, metavar="S",
                   help="on SIGTERM/SIGINT, seconds in-flight requests get to finish while new ones get 503 "
                        "(api.shutdown_grace_s, default 30; a second signal ends the wait at once)")
    p.add_argument("--batch-data-dir", default=None, metavar="DIR",
                   help="where the Batch API keeps its database and files (batch.data_dir; "
                        "default $XDG_STATE_HOME/mm-serve/batches)")
    p.add_argument("--cluster-backend", choices=["local", "ray"], default=None,
                   help="local: worker processes on this machine; ray: Ray actors on the nodes of a Ray "
                        "cluster (cluster.backend; docs/multi_node.md)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="Ray cluster to join with cluster.backend ray (cluster.address; default auto: "
                        "the cluster `ray start` made on this machine)")
    p.add_argument("--tool-call-parser", choices=["auto", "hermes", "llama3_json"], default=None,
                   help="how tool calls are found in free output (api.tool_call_parser; default auto: by the "
                        "checkpoint's decoder)")
    p.add_argument("--no-auto-placement", action="store_true",
                   help="serve the config's placement as it is, not the planner's choice (placement.auto false)")
    p.add_argument("--no-admission", action="store_true",
                   help="no latency prediction at admission (admission.predict false); the hard bounds stay")
    p.set_defaults(func=run)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    pairs = {
        "model": args.model, "served_model_name": args.served_model_name, "api.host": args.host,
        "api.port": args.port, "mode": args.mode, "dtype": args.dtype, "attention_backend": args.attention_backend,
        "compute.prefill_workers": args.prefill_workers,
        "compute.decode_workers": args.decode_workers,
        "api.api_key": args.api_key[0] if args.api_key and len(args.api_key) == 1 else args.api_key,
        "api.cache_salt_by_api_key": args.cache_salt_by_api_key,
        "api.allowed_local_media_path": args.allowed_local_media_path,
        "api.allowed_media_domains": args.allowed_media_domains, "api.shutdown_grace_s": args.shutdown_grace_s,
        "batch.data_dir": args.batch_data_dir, "cluster.backend": args.cluster_backend,
        "cluster.address": args.ray_address, "api.tool_call_parser": args.tool_call_parser,
        "admission.predict": False if args.no_admission else None,
        "placement.auto": False if getattr(args, "no_auto_placement", False) else None,
    }
    return {k: v for k, v in pairs.items() if v is not None}


def _check_http_stack(event_loop: str, http_parser: str) -> None:
    """Fail fast when ``api.event_loop`` / ``api.http_parser`` name a package that is not installed
    (uvicorn would fail only once the workers are up)."""
    from importlib.util import find_spec

    for key, value, package in (("api.event_loop", event_loop, "uvloop"), ("api.http_parser", http_parser, "httptools")):
        if value == package and find_spec(package) is None:
            raise CLIError(f"{key} is {value!r} but {package} is not installed (pip install {package}), "
                           f"or set {key}: auto")


def _check_port_free(host: str, port: int) -> None:
    """Fail fast (before starting workers) when the address cannot be bound."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise CLIError(f"cannot resolve --host {host}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise CLIError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _python() -> str:
    """This interpreter, relative to the working directory when it lies under it (``.venv/bin/python``)."""
    exe = Path(sys.executable)
    try:
        return str(exe.relative_to(Path.cwd()))
    except ValueError:
        return str(exe)


def _banner(host: str, port: int, name: str, api_key: str | None, vision: bool, dtype: str = "float32",
            attention: str = "auto") -> str:
    """What to print once every worker is ready: the URL and a first request to paste.

    A model that sees gets an image question about a scene drawn by the embedded model's
    scene generator (what the embedded model answers); a text-only one a text question.
    """
    url = f"http://{host}:{port}"
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    if vision:
        draw = f"  {_python()} -m mm_serve.shapes draw --out scene.png --seed 5\n"
        content = ('[{"type": "image_url", "image_url": {"url": "data:image/png;base64,\'"$(base64 -w0 scene.png)"\'"}}, '
                   '{"type": "text", "text": "Describe the image."}]')
    else:
        draw, content = "", '"The capital of France is"'
    return (
        f"mm-serve is ready at {url}  (model: {name}, {dtype}, attention {attention})\n"
        f"Playground: {url}/playground   Dashboard: {url}/dashboard\n"
        f"Try it:\n{draw}"
        f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"    -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": {content}}}], "
        f"\"max_tokens\": 32, \"temperature\": 0}}'\n"
        f"Health: {url}/health   OpenAPI: {url}/docs   Stop: Ctrl-C"
    )


def _placement(cfg: Any, model_dir: Path) -> tuple[Any, dict[str, Any]]:
    """The config to serve and how its placement was chosen (for /health): the planner's choice
    for this machine (mm_serve.planner.auto_placement) when the config pins no placement and
    ``placement.auto`` is on, else the config's own. A planner that cannot plan leaves the
    config's placement, with a warning that says why."""
    from mm_serve.models.model_config import CheckpointError
    from mm_serve.models.registry import load_model_config
    from mm_serve.planner.auto_placement import (
        apply_placement,
        cached_profile,
        choose_placement,
        default_profile_dir,
        pinned_keys,
        usable_cores,
    )
    from mm_serve.planner.errors import PlannerError, ProfileError
    from mm_serve.workloads import WorkloadError

    pinned = pinned_keys(cfg)
    own: dict[str, Any] = {"source": "config", "mode": cfg.mode}
    if cfg.mode != "colocated":  # one colocated worker runs both phases: no counts of either
        own.update(prefill_workers=cfg.compute.prefill_workers, decode_workers=cfg.compute.decode_workers)
    if not cfg.placement.auto or pinned:
        reason = "placement.auto is false" if not cfg.placement.auto else f"given: {', '.join(pinned)}"
        return cfg, {**own, "reason": reason}

    def log(line: str) -> None:
        say(f"mm-serve: {line}", sys.stdout)

    cores = usable_cores()
    if len(cores) < 2:  # nothing to split: one worker does both phases
        log("placement colocated: one usable core (a prefill and a decode worker would share it)")
        return apply_placement(cfg, "colocated"), {"source": "rule", "chosen": "colocated", "mode": "colocated",
                                                   "reason": "one usable core"}
    profile_dir = Path(cfg.placement.profile_dir).expanduser() if cfg.placement.profile_dir else default_profile_dir()
    try:
        dtype = cfg.serving_dtype(load_model_config(model_dir).raw)
        profile, measured = cached_profile(model_dir, dtype, len(cores), profile_dir, log)
        choice = choose_placement(cfg, model_dir, profile, cores, measured)
    except CheckpointError:  # the checkpoint cannot serve either: said once, not as the planner's trouble
        raise
    except (PlannerError, ProfileError, WorkloadError, ValueError) as exc:
        say(f"mm-serve: warning: placement.auto: the planner cannot choose ({exc}); serving the config's "
            f"placement ({cfg.mode}; pin one with --mode or turn this off with --no-auto-placement)")
        return cfg, {**own, "reason": f"planner: {exc}"}
    log(choice.describe())
    return apply_placement(cfg, **choice.keys), choice.as_dict()


def _keep_front_end_off_paced_decode(holder: Any) -> None:
    """Pin this process off the cores of decode workers that pace (:mod:`mm_serve.cluster.front_end_cores`),
    and say so; nothing where none paces or no other core is left."""
    from mm_serve.cluster.front_end_cores import keep_off, paced_decode_cpus

    workers = holder.client.pool.workers.values()
    cores = paced_decode_cpus(worker.spec for worker in workers)
    now = keep_off(cores, {worker.process.pid for worker in workers if worker.process is not None})
    if now is not None:
        say(f"mm-serve: the front end runs on cores {now}, off the paced decode worker's {sorted(cores)}", sys.stdout)


def _bound_port(server: Any, asked: int) -> int:
    """The port uvicorn's listener is bound to (``--port 0`` asks the system for a free one), else ``asked``."""
    for listener in getattr(server, "servers", []):
        for sock in getattr(listener, "sockets", []):
            return int(sock.getsockname()[1])
    return asked


def _interrupt(signum: int, frame: Any) -> None:
    """SIGINT or SIGTERM before uvicorn takes the signals over: stop the start as Ctrl-C does, once; a
    second signal is ignored, so it cannot cut short the stop of the workers already started."""
    _ignore_signals()
    raise StopSignal


def _ignore_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _check_admission_profile(path: str | None) -> None:
    """``admission.profile`` loads as a profile (read again by the admission controller once the workers start).

    Raises:
        CLIError: missing, unreadable or not a valid profile.
    """
    if path is None:
        return
    from mm_serve.planner.errors import ProfileError
    from mm_serve.planner.profile_file import load_profile

    try:
        load_profile(path)
    except ProfileError as exc:
        raise CLIError(f"admission.profile: {exc}") from None


def run(args: argparse.Namespace) -> int:
    """Validate the config, start uvicorn (workers start in the background), print the banner when ready."""
    # Until uvicorn takes the signals over (it restores these after), SIGTERM stops the start as Ctrl-C
    # does: the workers started below are then stopped and their segments unlinked, not left to find
    # their parent gone.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    from mm_serve.runtime.heap_freeze import defer_collection, freeze_startup_heap

    defer_collection()  # through the imports and the engine's start (announce() below freezes the heap then)
    import uvicorn

    from mm_serve.config import ConfigError, load_config
    from mm_serve.engine.engine_holder import EngineHolder
    from mm_serve.models.model_config import CheckpointError
    from mm_serve.models.named_models import resolve_model
    from mm_serve.models.weights import check_weight_files

    try:
        cfg = load_config(args.config, _overrides(args))
        model_dir = resolve_model(cfg.model)
        check_weight_files(model_dir)  # its headers (milliseconds): no weights or a file cut short is said here once
        if cfg.attention_backend == "flex" and not cfg.compute.uses_gpus:
            raise CLIError("attention_backend flex runs eager FlexAttention on a CPU: dense scores over every page "
                           "of the cache (gigabytes and seconds a pass), for tests only; serve on a CPU with auto "
                           "(docs/attention.md)")
        if cfg.api.allowed_local_media_path and not Path(cfg.api.allowed_local_media_path).is_dir():
            raise CLIError(f"--allowed-local-media-path {cfg.api.allowed_local_media_path} is not a directory")
        _check_http_stack(cfg.api.event_loop, cfg.api.http_parser)
        _check_port_free(cfg.api.host, cfg.api.port)
        _check_admission_profile(cfg.admission.profile)
        cfg, placement = _placement(cfg, model_dir)
        for line in cfg.ineffective_settings():
            say(f"mm-serve: warning: {line}")
        from mm_serve.runtime.step_log import step_log_problem

        if (problem := step_log_problem()) is not None:  # the workers' own notice goes to their log files
            say(f"mm-serve: warning: {problem}")
        say(f"mm-serve: starting {cfg.mode} workers for {model_dir} ...", sys.stdout)
        # The workers start now, on a thread, and this process loads the tokenizer, media processors
        # and app while they load the model: about 2 s of a start.
        holder = EngineHolder(model_dir, cfg, start_now=True)
    except (ConfigError, CheckpointError) as exc:
        raise CLIError(str(exc)) from None
    try:
        # imported once the workers are starting (0.4 s of imports they need not wait for)
        from mm_serve.pipeline.context import ServerContext
        from mm_serve.server.app import build_app
        from mm_serve.server.draining_server import DrainingServer
        from mm_serve.server.guarded_http import HTTPLimits, guarded_h11

        name = cfg.served_model_name or str(cfg.model)
        ctx = ServerContext(holder=holder, config=cfg, served_model_name=name, placement=placement)
        app = build_app(ctx)
        http: Any = cfg.api.http_parser if cfg.api.http_parser == "httptools" else guarded_h11(HTTPLimits(
            cfg.api.max_header_bytes, cfg.api.header_timeout_s, cfg.api.max_connections))
        server = DrainingServer(uvicorn.Config(app, host=cfg.api.host, port=cfg.api.port, log_level="warning",
                                               loop=cfg.api.event_loop, http=http,
                                               timeout_keep_alive=cfg.api.keep_alive_timeout_s,
                                               timeout_graceful_shutdown=5), holder, cfg.api.shutdown_grace_s,
                                 lambda: ctx.admitting)
    except BaseException:
        holder.stop()
        raise

    failed: list[bool] = []
    usage_error: list[bool] = []
    announced: list[bool] = []

    def announce() -> None:
        holder.ready_event.wait()
        freeze_startup_heap()  # the imports, tokenizer, app and engine client: no full collection walks them
        if server.should_exit:  # Ctrl-C / SIGTERM during warm-up: the start was stopped, not failed
            return
        if holder.start_error:
            failed.append(True)
            if holder.start_user_error:  # one line that says what to change: a usage error's exit status
                usage_error.append(True)
                say(f"mm-serve: error: {holder.start_error}")
            else:
                say(f"mm-serve: error: workers failed to start:\n{holder.start_error}")
            server.should_exit = True
        else:
            _keep_front_end_off_paced_decode(holder)
            while not server.started and not server.should_exit:  # the port bound (--port 0: known only then)
                time.sleep(0.01)
            say(_banner(cfg.api.host, _bound_port(server, cfg.api.port), name, next(iter(cfg.api.api_keys), None),
                        holder.model_config.vision is not None, holder.client.config.dtype, cfg.attention_backend),
                sys.stdout)
            announced.append(True)

    def exit_when_unavailable() -> None:  # fault.exit_when_unavailable: a supervisor starts a fresh service
        holder.unavailable.wait()
        if server.should_exit:
            return
        failed.append(True)
        say(f"mm-serve: error: {holder.unavailable_reason}; exiting so that a supervisor can start "
            "the service again (fault.exit_when_unavailable)")
        server.should_exit = True

    threading.Thread(target=announce, daemon=True).start()
    if cfg.fault.exit_when_unavailable:
        threading.Thread(target=exit_when_unavailable, name="mm-serve-unavailable", daemon=True).start()
    try:
        server.run()  # on the loop of api.event_loop (asyncio.run would ignore it)
    except KeyboardInterrupt:
        pass
    finally:
        _ignore_signals()  # the server has stopped: nothing may cut the workers' stop short
        holder.stop()  # the lifespan's shutdown has stopped them, unless uvicorn ended before its startup
    say("mm-serve: stopped (workers and shared memory released)")
    if usage_error:
        return 2
    if failed or not server.started:
        return 1
    if not announced:  # a signal while the workers still loaded: the start was stopped, as before uvicorn ran
        say("mm-serve: interrupted before the workers were ready")
        return 130
    return 0
