"""KV sharing (issue #21): prefix caching on vs off on the three workloads that repeat content.

For each workload (``multiturn-llava``: 5-turn image chats, each turn sent after the
previous answer with the whole history; ``shared-prompt``: one 400-token system prompt
for every request; ``caption-repeat``: every image captioned 3 times) the script starts
``mm-serve serve`` twice on 127.0.0.1, from the same config with
``kv_cache.enable_prefix_caching: false`` then ``true`` (a temporary YAML passed with
``--config``), and measures each with ``mm-serve bench``'s machinery
(:func:`mm_serve.bench.session.measure`), same requests, same seed:

* ``multiturn-llava`` and ``caption-repeat``: unloaded requests, then one run at a fixed
  rate (``--rate-multiturn``, ``--rate-caption``, requests/s), never stopped early, so
  every turn's TTFT is measured;
* ``shared-prompt``: a goodput sweep (``--start-rate``, ``--rate-tolerance``).

Admission control's predictor is off in both servers (``admission.predict: false``;
``--admission`` keeps the config's): it predicts TTFT without knowing about cached
prefixes, so its refusals would blur the comparison.

It prints side by side TTFT p50/p90 (per turn for the conversations), goodput or SLO
attainment, and the hit rates (``usage.prompt_tokens_details.cached_tokens`` over
prompt tokens; the server's ``/metrics`` prefix- and encoder-cache counters), then the
goals with PASS/MISS: turns 2+ of the image chat at least 3x lower TTFT p50 with caching
on, the shared-prompt workload at least 1.5x the goodput; a goal passes only when the
caching-on server also reported cache hits, since on a shared machine two runs of the
same server can differ by more than that. Writes ``kv_sharing.json``
(the figures) and ``bench-<workload>.json`` (every run) to ``--out``.

The servers run with ``TMPDIR`` in the script's temporary directory, so each one's run
directory is known; after each stop, ``/dev/shm`` segments of those instances that are
still there are removed, and the temporary directory goes at the end, on Ctrl-C and
SIGTERM too. Takes about 10-15 minutes on the 2-core dev machine. Not part of ``make
test``. Usage::

    python benchmarks/kv_sharing.py [--model out/bench-llava] [--config configs/image_chat.yaml]
        [--workloads multiturn-llava,shared-prompt,caption-repeat] [--slo-ttft 1 --slo-tpot 0.05]
        [--rate-multiturn 1.0] [--rate-caption 2.0] [--start-rate 2.0] [--num-requests 40]
        [--off-override cache.encoder_cache_bytes=0] [--out bench_out/kv_sharing]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from mm_serve.bench.launch import LaunchError, LocalServer  # noqa: E402
from mm_serve.bench.metrics import RunSummary  # noqa: E402
from mm_serve.bench.report import SystemResult, write_json  # noqa: E402
from mm_serve.bench.runner import LoadSpec  # noqa: E402
from mm_serve.bench.server_metrics import PREFIX_HITS, encoder_hit_rate, prefix_hit_rate  # noqa: E402
from mm_serve.bench.session import BenchSettings, measure  # noqa: E402
from mm_serve.ground.slo import SLO  # noqa: E402
from mm_serve.models.registry import load_model_config  # noqa: E402
from mm_serve.workloads import make_workload  # noqa: E402

WORKLOADS = ("multiturn-llava", "shared-prompt", "caption-repeat")
SETTINGS = ("off", "on")  # kv_cache.enable_prefix_caching false, true
TTFT_GOAL = 3.0  # multiturn-llava: turns 2+ TTFT p50, off / on
GOODPUT_GOAL = 1.5  # shared-prompt: goodput, on / off
SHM_DIR = Path("/dev/shm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="out/bench-llava", help="llava checkpoint; built with the bench spec if missing")
    p.add_argument("--config", default="configs/image_chat.yaml", help="base server config YAML")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of " + ", ".join(WORKLOADS))
    p.add_argument("--slo-ttft", type=float, default=1.0, help="TTFT SLO, s (default 1)")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="TPOT SLO, s (default 0.05)")
    p.add_argument("--rate-multiturn", type=float, default=1.0, help="multiturn-llava rate, requests/s")
    p.add_argument("--rate-caption", type=float, default=2.0, help="caption-repeat rate, requests/s")
    p.add_argument("--start-rate", type=float, default=2.0, help="first rate of the shared-prompt sweep, requests/s")
    p.add_argument("--rate-tolerance", type=float, default=0.25, help="sweep precision, relative")
    p.add_argument("--num-requests", type=int, default=40, help="requests per run (multiturn: 8 conversations)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--off-override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra dotted config key for the 'off' server only (YAML value), e.g. "
                        "cache.encoder_cache_bytes=0; repeatable")
    p.add_argument("--admission", action="store_true",
                   help="keep the config's admission.predict (default: off in both servers)")
    p.add_argument("--out", default="bench_out/kv_sharing", help="folder for kv_sharing.json and bench-*.json")
    args = p.parse_args(argv)
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workload(s) {', '.join(sorted(unknown))}; choose from {', '.join(WORKLOADS)}")
    return args


def ensure_model(model: str) -> Path:
    """The checkpoint directory, built with the bench llava spec (seeded) when it does not exist."""
    path = Path(model)
    if not (path / "config.json").is_file():
        print(f"building the bench llava checkpoint into {path} ...", flush=True)
        subprocess.run([sys.executable, "-m", "mm_serve.models.builder", "bench", "--out", str(path)], check=True)
    return path


def set_dotted(doc: dict[str, Any], key: str, value: Any) -> None:
    """``doc[a][b][c] = value`` for ``key`` ``"a.b.c"``, creating the sections on the way."""
    *sections, last = key.split(".")
    for name in sections:
        doc = doc.setdefault(name, {})
    doc[last] = value


def write_config(base: str, setting: str, overrides: list[str], folder: Path, admission: bool) -> Path:
    """The base config with ``kv_cache.enable_prefix_caching`` (and, for off, the overrides;
    without ``admission``, ``admission.predict: false``), as a temp YAML."""
    doc = yaml.safe_load(Path(base).read_text()) or {}
    set_dotted(doc, "kv_cache.enable_prefix_caching", setting == "on")
    if not admission:
        set_dotted(doc, "admission.predict", False)
    for item in overrides if setting == "off" else ():
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--off-override {item!r}: expected KEY=VALUE")
        set_dotted(doc, key, yaml.safe_load(text))
    path = folder / f"config-{setting}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def remove_leftover_segments(tmp: Path) -> list[str]:
    """Unlink ``/dev/shm`` segments of the service instances whose run directories are in ``tmp``."""
    removed = []
    for run_dir in tmp.glob("mmsrv-*"):
        instance = run_dir.name.split("-")[1]
        for segment in SHM_DIR.glob(f"mmsrv-{instance}-*"):
            segment.unlink(missing_ok=True)
            removed.append(segment.name)
    return removed


def settings_for(workload: str, args: argparse.Namespace, model: Path, out: Path) -> BenchSettings:
    """What ``mm-serve bench`` would run for ``workload``: a sweep for shared-prompt, else one rate."""
    shape = load_model_config(model)
    vision = shape.vision
    if vision is None:
        raise SystemExit(f"{model} has no vision tower; the image workloads need a llava checkpoint")
    wl = make_workload(workload, vision.num_image_tokens, shape.text.max_position_embeddings)
    sweep = workload == "shared-prompt"
    rate = args.rate_multiturn if workload == "multiturn-llava" else args.rate_caption
    load = LoadSpec(wl, args.seed, duration_s=20.0, num_requests=args.num_requests)  # <= 60 s of arrivals a run
    return BenchSettings(load=load, sweep=sweep,
                         rate=None if sweep else rate, start_rate=args.start_rate, rel_tol=args.rate_tolerance,
                         tokenizer_dir=model, image_size=vision.image_size, records_dir=out, early_stop=sweep)


def measure_setting(workload: str, setting: str, args: argparse.Namespace, model: Path, tmp: Path,
                    out: Path) -> SystemResult:
    """Start a server with prefix caching ``setting`` on or off, measure ``workload``, stop it."""
    config = write_config(args.config, setting, args.off_override, tmp, args.admission)
    settings = settings_for(workload, args, model, out)
    (out / f"records-{workload}-{setting}.jsonl").unlink(missing_ok=True)  # records append; start afresh
    os.environ["TMPDIR"] = str(tmp)  # the server's run directory, hence its instance id, lands here
    server = LocalServer(out / f"server-{workload}-{setting}.log", str(config), str(model))
    try:
        url = server.start()
        result, _ = measure(f"{workload}-{setting}", url, settings, SLO(args.slo_ttft, args.slo_tpot), "bench",
                            log=lambda line: print(line, flush=True))
        return result
    finally:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop short
        try:
            server.stop()
        finally:
            signal.signal(signal.SIGINT, previous)
        left = remove_leftover_segments(tmp)
        if left:
            print(f"removed {len(left)} /dev/shm segment(s) the server left: {', '.join(left)}", flush=True)


def main_run(result: SystemResult) -> RunSummary:
    """The run the figures come from: the fixed-rate run, or the sweep's run at the goodput
    (its lowest run when nothing passed)."""
    if result.single is not None:
        return result.single
    sweep = result.sweep
    if sweep is None or not sweep.runs:
        return result.unloaded
    return sweep.run_at(sweep.goodput) or sweep.runs[0]


def figures(result: SystemResult) -> dict[str, Any]:
    """The side-by-side figures of one (workload, setting); times in s, rates in requests/s, rates 0..1."""
    run = main_run(result)
    return {
        "rate": run.rate, "goodput": result.sweep.goodput if result.sweep else None,
        "attainment": run.attainment, "ttft_p50": run.ttft.p50, "ttft_p90": run.ttft.p90,
        "ttft_by_turn": {k: {"p50": d.p50, "p90": d.p90, "count": d.count} for k, d in run.ttft_by_turn.items()},
        "cached_tokens_hit_rate": run.cache.hit_rate, "cached_tokens": run.cache.cached_tokens,
        "prompt_tokens": run.cache.prompt_tokens,
        "server_prefix_hit_rate": prefix_hit_rate(run.server_counters),
        "server_encoder_hit_rate": encoder_hit_rate(run.server_counters),
        "server_counters": run.server_counters, "unloaded_ttft_p50": result.unloaded.ttft.p50,
    }


def ratio(a: float | None, b: float | None) -> float:
    """``a / b``; NaN when either is missing or ``b`` is 0."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return math.nan
    return a / b


def reported_hits(on: dict[str, Any]) -> bool:
    """Whether the caching-on server said it reused anything (cached_tokens or its /metrics counters)."""
    return on["cached_tokens"] > 0 or on["server_counters"].get(PREFIX_HITS, 0.0) > 0


def goal(name: str, value: float, target: float, on: dict[str, Any]) -> dict[str, Any]:
    """One goal's verdict: it passes when ``value >= target`` and the caching-on server reported
    cache hits (without any, a gap between the two servers is noise of the shared machine)."""
    hits = reported_hits(on)
    note = "" if hits else "no cache hits reported by the caching-on server, so any gap is noise"
    return {"goal": name, "value": value, "target": target, "pass": value >= target and hits, "note": note}


def goals(table: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The issue's two goals, for the workloads measured."""
    out = []
    if "multiturn-llava" in table:
        chat = table["multiturn-llava"]
        off, on = (chat[s]["ttft_by_turn"].get("2+", {}).get("p50") for s in SETTINGS)
        out.append(goal("multiturn-llava turns 2+ TTFT p50, off / on", ratio(off, on), TTFT_GOAL, chat["on"]))
    if "shared-prompt" in table:
        shared = table["shared-prompt"]
        value = ratio(shared["on"]["goodput"], shared["off"]["goodput"])
        out.append(goal("shared-prompt goodput, on / off", value, GOODPUT_GOAL, shared["on"]))
    return out


def _fmt(x: Any, scale: float = 1.0, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x * scale:.{digits}f}"


def rows_of(workload: str, off: dict[str, Any], on: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(figure, off, on) lines of one workload."""
    rows = [(f"rate (req/s){' at goodput' if off['goodput'] is not None else ''}", _fmt(off["rate"]), _fmt(on["rate"]))]
    if off["goodput"] is not None or on["goodput"] is not None:
        rows.append(("goodput (req/s)", _fmt(off["goodput"]), _fmt(on["goodput"])))
    rows += [("SLO attainment (%)", _fmt(off["attainment"], 100, 1), _fmt(on["attainment"], 100, 1)),
             ("TTFT p50 / p90 (s)", f"{_fmt(off['ttft_p50'])} / {_fmt(off['ttft_p90'])}",
              f"{_fmt(on['ttft_p50'])} / {_fmt(on['ttft_p90'])}")]
    turns = sorted(set(off["ttft_by_turn"]) | set(on["ttft_by_turn"]), key=lambda k: (k != "1", k != "2+", k))
    for k in turns:
        cells = [f"{_fmt(f['ttft_by_turn'].get(k, {}).get('p50'))} / {_fmt(f['ttft_by_turn'].get(k, {}).get('p90'))}"
                 for f in (off, on)]
        rows.append((f"  {'turns' if k == '2+' else 'turn'} {k} TTFT p50 / p90 (s)", cells[0], cells[1]))
    rows += [("cached_tokens / prompt tokens (%)", _fmt(off["cached_tokens_hit_rate"], 100, 1),
              _fmt(on["cached_tokens_hit_rate"], 100, 1)),
             ("server prefix-cache hit (%)", _fmt(off["server_prefix_hit_rate"], 100, 1),
              _fmt(on["server_prefix_hit_rate"], 100, 1)),
             ("server encoder-cache hit (%)", _fmt(off["server_encoder_hit_rate"], 100, 1),
              _fmt(on["server_encoder_hit_rate"], 100, 1))]
    return [(f"{workload if i == 0 else '':<16} {name}", a, b) for i, (name, a, b) in enumerate(rows)]


def print_table(table: dict[str, dict[str, dict[str, Any]]], checks: list[dict[str, Any]]) -> None:
    print(f"\n{'workload / figure':<52} {'caching off':>17} {'caching on':>17}")
    for workload, by_setting in table.items():
        for name, off, on in rows_of(workload, by_setting["off"], by_setting["on"]):
            print(f"{name:<52} {off:>17} {on:>17}")
    print()
    for check in checks:
        verdict = "PASS" if check["pass"] else "MISS"
        note = f" ({check['note']})" if check["note"] else ""
        print(f"{verdict}  {check['goal']} = {_fmt(check['value'], 1, 2)}x (goal >= {check['target']:g}x){note}")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):  # both unwind through the finally blocks below
        signal.signal(sig, _interrupt)
    started, load_before = time.monotonic(), os.getloadavg()[0]
    if load_before > 1.0:
        print(f"warning: load average {load_before:.1f} on {os.cpu_count()} cores: other jobs will disturb "
              "the figures (run it on a quiet machine)", flush=True)
    model = ensure_model(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="kv-sharing-") as tmp_name:
        tmp = Path(tmp_name)
        try:
            for workload in args.workloads.split(","):
                results = [measure_setting(workload, s, args, model, tmp, out) for s in SETTINGS]
                write_json(out / f"bench-{workload}.json", results, SLO(args.slo_ttft, args.slo_tpot), 0.9,
                           {"workload": workload, "config": args.config, "model": str(model)})
                table[workload] = {s: figures(r) for s, r in zip(SETTINGS, results, strict=True)}
        except LaunchError as exc:
            print(f"kv_sharing: a server did not start: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\nkv_sharing: interrupted; servers stopped, temporary files removed", file=sys.stderr)
            return 130
    checks = goals(table)
    print_table(table, checks)
    doc = {"slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot}, "settings": vars(args),
           "load_average": {"start": load_before, "end": os.getloadavg()[0]},
           "workloads": table, "goals": checks}
    (out / "kv_sharing.json").write_text(json.dumps(strict(doc), indent=1) + "\n")
    print(f"\nwrote {out / 'kv_sharing.json'} ({(time.monotonic() - started) / 60:.1f} min)")
    return 0


def strict(value: Any) -> Any:
    """NaN and infinities -> None, recursively, so the file is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
