"""Planner calibration: simulated SLO attainment next to measured, at three rates.

DistServe validates its simulator by comparing its SLO attainment with the real
system's (arXiv:2401.09670, §6.5, Table 2: within 2 %). This script does the same for
mm-serve on this machine:

1. ``mm-serve profile`` times our engine's forward passes for the benchmark model (one
   torch thread, as each pinned worker runs) and writes a profile; the planner fits
   its roofline coefficients to it (``mm_serve.planner.fit``).
2. ``mm-serve bench --rate R`` runs the benchmark workload against our service
   (``configs/default.yaml``: 1 prefill + 1 decode worker) at each rate and writes
   every request's record (send time, prompt and output tokens, TTFT, TPOT).
3. The planner's discrete-event simulator replays exactly those requests (same send
   times, same prompt and output lengths) on one prefill and one decode instance with
   the fitted times and the config's batch limits and KV capacity, and computes the
   attainment of the same SLOs.

It prints, per rate, measured and simulated attainment and their difference in
percentage points, plus mean TTFT and TPOT of both. Goal: within 5 points.

Usage::

    python benchmarks/planner_calibration.py [--model bench-llama|DIR] [--workload chatbot]
        [--rates 0.3,0.5,0.7] [--num-requests 45] [--slo-ttft 1.0 --slo-tpot 0.05]
        [--profile PROFILE.json] [--out bench_out/calibration]

``--profile`` reuses a profile instead of measuring one; ``--records-only`` skips the
bench runs and re-simulates the records already in ``--out``. Text workloads only
(``chatbot`` or a JSONL file without images): the bench records carry no image count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mm_serve.config import ConfigError, ServiceConfig, load_config  # noqa: E402
from mm_serve.ground.slo import SLO  # noqa: E402
from mm_serve.planner.errors import PlannerError  # noqa: E402
from mm_serve.planner.fit import fit_profile_file  # noqa: E402
from mm_serve.planner.latency_model import LatencyModel, ParallelConfig  # noqa: E402
from mm_serve.planner.sim_request import SimRequest  # noqa: E402
from mm_serve.planner.simulator import (  # noqa: E402
    DecodeServer,
    Handoff,
    PrefillServer,
    simulate_disaggregated,
)

_PRESETS = {"bench-llama": "bench-llama", "bench": "bench"}  # builder commands of the presets


def _model_dir(name: str) -> Path:
    """A checkpoint directory: ``name`` itself, or a bench preset built once under ``./out/``."""
    if Path(name).is_dir():
        return Path(name)
    if name not in _PRESETS:
        sys.exit(f"--model: {name!r} is neither a directory nor one of {sorted(_PRESETS)}")
    target = Path("out") / name
    if not (target / "config.json").is_file():
        _run([sys.executable, "-m", "mm_serve.models.builder", _PRESETS[name], "--out", str(target)])
    return target


def _run(cmd: list[str]) -> None:
    print("$", " ".join(cmd), flush=True)
    result = subprocess.run(cmd, check=False)
    if result.returncode:
        sys.exit(f"command failed with exit status {result.returncode}: {' '.join(cmd)}")


_CLI = [sys.executable, "-c", "import sys; from mm_serve.cli.main import main; sys.exit(main())"]


def _records(path: Path, rate: float) -> list[dict[str, object]]:
    """The bench's per-request rows (``records-<system>.jsonl``) of the run at ``rate``, in
    plan order (the file also holds the unloaded requests, written with rate 0)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted((r for r in rows if abs(float(r["rate"]) - rate) < 1e-9), key=lambda r: int(r["index"]))


def measured_attainment(rows: list[dict[str, object]], slo: SLO) -> tuple[float, float, float]:
    """(attainment, mean TTFT s, mean TPOT s) of the bench records; a failed request misses."""
    ok = 0
    ttfts, tpots = [], []
    for r in rows:
        ttft, tpot = r.get("ttft_s"), float(r.get("tpot_s") or 0.0)
        good = r.get("error") is None and ttft is not None
        if good:
            ttfts.append(float(ttft))
            tpots.append(tpot)
        ok += int(good and float(ttft) <= slo.ttft_s and tpot <= slo.tpot_s)
    n = max(1, len(rows))
    return ok / n, sum(ttfts) / max(1, len(ttfts)), sum(tpots) / max(1, len(tpots))


def one_prefill_one_decode(model: LatencyModel, cfg: ServiceConfig) -> tuple[PrefillServer, DecodeServer, Handoff]:
    """The simulator's 1P+1D of this machine: one prefill and one decode instance of one device each
    (TP1), ``cfg``'s batch limits and KV capacity, and their hand-off (a shared-memory copy: ~free)."""
    par = ParallelConfig(1, 1)
    prefill = PrefillServer(model.prefill_timing(par), cfg.scheduler.prefill_token_budget,
                            cfg.scheduler.prefill_batch_size)
    capacity = cfg.kv_cache.max_pages_per_gpu * cfg.kv_cache.page_size
    decode = DecodeServer(model.decode_timing(par), capacity, cfg.scheduler.decode_max_concurrent)
    return prefill, decode, Handoff(model.hardware.collective_latency_s, 0.0)


def simulated_attainment(
    rows: list[dict[str, object]], model: LatencyModel, config_path: Path | None, slo: SLO
) -> tuple[float, float, float]:
    """(attainment, mean TTFT s, mean TPOT s) of the same requests in the simulator: one
    prefill and one decode instance (TP1), the config's batch limits and KV capacity."""
    cfg = load_config(config_path) if config_path else load_config(None)
    prefill, decode, handoff = one_prefill_one_decode(model, cfg)
    requests = [
        SimRequest(i, float(r["sent_s"]), int(r["prompt_tokens"] or 1), max(1, int(r["output_tokens"] or 1)),
                   int(r.get("num_images") or 0))
        for i, r in enumerate(rows) if r.get("sent_s") is not None
    ]
    result = simulate_disaggregated([prefill], [decode], [[handoff]], requests)
    # requests never sent count as misses, as in the measured figure
    ok = sum(1 for r in requests if r.ttft <= slo.ttft_s and r.tpot <= slo.tpot_s)
    return ok / max(1, len(rows)), result.mean_ttft(), result.mean_tpot()


def _rates(text: str, parser: argparse.ArgumentParser) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        parser.error(f"--rates must be comma-separated numbers, got {text!r}")
    if not rates or not all(math.isfinite(r) and r > 0 for r in rates):
        parser.error(f"--rates needs rates > 0 requests/s, got {text!r}")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bench-llama", help="bench-llama, bench, or a checkpoint dir")
    parser.add_argument("--workload", default="chatbot", help="chatbot or a text-only JSONL workload")
    parser.add_argument("--rates", default="0.3,0.5,0.7", help="comma-separated requests/s")
    parser.add_argument("--num-requests", type=int, default=45, help="requests per bench run")
    parser.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.05, help="seconds")
    parser.add_argument("--config", type=Path, default=None, help="service config (default: configs/default.yaml)")
    parser.add_argument("--profile", type=Path, default=None, help="reuse this profile instead of measuring")
    parser.add_argument("--out", type=Path, default=Path("bench_out/calibration"))
    parser.add_argument("--records-only", action="store_true", help="re-simulate the records in --out")
    args = parser.parse_args()
    rates = _rates(args.rates, parser)
    if args.num_requests < 1:
        parser.error(f"--num-requests must be >= 1, got {args.num_requests}")
    if not (args.slo_ttft > 0 and args.slo_tpot > 0):
        parser.error(f"SLOs must be > 0 s, got --slo-ttft {args.slo_ttft} --slo-tpot {args.slo_tpot}")
    if args.workload in ("llava", "caption"):
        parser.error("image workloads are not supported: the bench records carry no image count")
    profile = args.profile or args.out / "profile.json"
    if (args.profile or args.records_only) and not profile.is_file():
        parser.error(f"no profile at {profile} (give --profile, or run without --records-only to measure one)")
    try:
        run(args, rates, profile)
    except (ConfigError, PlannerError) as exc:
        sys.exit(f"error: {exc}")


def run(args: argparse.Namespace, rates: list[float], profile: Path) -> None:
    """Profile (unless given), bench each rate (unless ``--records-only``), simulate, print."""
    slo = SLO(args.slo_ttft, args.slo_tpot)
    model_dir = Path(args.model) if args.records_only else _model_dir(args.model)
    if not args.records_only:
        args.out.mkdir(parents=True, exist_ok=True)
    if args.profile is None and not args.records_only:
        _run([*_CLI, "profile", "--model", str(model_dir), "--out", str(profile), "--threads", "1"])
    fit = fit_profile_file(profile)
    print(f"fit: prefill max error {fit.prefill.max_rel_error:.1%}, decode max error {fit.decode.max_rel_error:.1%}")
    model = LatencyModel(fit.shape, fit.hardware)
    rows_out = []
    for rate in rates:
        run_dir = args.out / f"rate-{rate:g}"
        if not args.records_only:
            shutil.rmtree(run_dir, ignore_errors=True)  # the bench appends to its records file
            cmd = [*_CLI, "bench", "--model", str(model_dir), "--workload", args.workload, "--rate", str(rate),
                   "--num-requests", str(args.num_requests), "--duration", str(args.num_requests / rate),
                   "--slo-ttft", str(args.slo_ttft), "--slo-tpot", str(args.slo_tpot), "--no-early-stop",
                   "--out", str(run_dir)]
            # the 1P+1D the planner simulates: configs/default.yaml pins it (without a config the planner would choose)
            cmd += ["--config", str(args.config or Path(__file__).resolve().parents[1] / "configs" / "default.yaml")]
            _run(cmd)
        found = sorted(run_dir.glob("records-*.jsonl"))
        if len(found) != 1:
            sys.exit(f"error: expected one records-*.jsonl in {run_dir}, found {[f.name for f in found]}")
        records = found[0]
        rows = _records(records, rate)
        if not rows:
            sys.exit(f"error: no requests at rate {rate:g} in {records}")
        measured = measured_attainment(rows, slo)
        simulated = simulated_attainment(rows, model, args.config, slo)
        rows_out.append((rate, len(rows), measured, simulated))
    print(f"\nSLO TTFT {slo.ttft_s:g} s, TPOT {slo.tpot_s * 1e3:g} ms; model {model_dir}; workload {args.workload}")
    print(f"{'rate':>6} {'reqs':>5} | {'measured':>8} {'simulated':>9} {'diff':>7} | "
          f"{'TTFT meas/sim (s)':>18} | {'TPOT meas/sim (ms)':>19}")
    for rate, n, (m_att, m_ttft, m_tpot), (s_att, s_ttft, s_tpot) in rows_out:
        print(f"{rate:>6g} {n:>5} | {100 * m_att:>7.1f}% {100 * s_att:>8.1f}% {100 * (s_att - m_att):>+6.1f} | "
              f"{m_ttft:>8.3f} / {s_ttft:<7.3f} | {1e3 * m_tpot:>8.1f} / {1e3 * s_tpot:<8.1f}")
    worst = max(abs(s[0] - m[0]) for _, _, m, s in rows_out)
    print(f"largest difference: {100 * worst:.1f} points (goal: within 5)")


if __name__ == "__main__":
    main()
