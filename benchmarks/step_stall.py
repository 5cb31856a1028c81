"""A worker's steps under load against its profile: how much longer each decode step ran than profiled.

Reads a step log (``MM_SERVE_STEP_LOG``, :mod:`mm_serve.runtime.step_log`) written while a benchmark ran,
and a profile of the same model on the same machine (``mm-serve profile``), and prints for one role's
decode steps (a colocated worker's: its steps without prompts; a decode worker's: its step periods):

* per band of batch sizes, the steps' wall seconds, their CPU seconds per thread, and the profile's
  fitted time for the same batch and context (on ``--threads`` threads: the profile's points of that
  degree), with the ratios;
* the least-squares line ``wall - profiled = a + b * batch`` over all those steps. ``b`` is what each
  running request adds to a step beyond the profile: on a worker whose threads span every core, the
  front end's CPU per streamed token (the planner's ``placement.front_end_ms_per_token``) plus the
  engine's per-token work outside the forward pass.

Usage::

    MM_SERVE_STEP_LOG=/tmp/steps.jsonl mm-serve bench --config colocated.yaml --model out/bench-llama \\
        --workload chatbot --rate 3 --num-requests 150 --no-admission
    mm-serve profile --model out/bench-llama --threads 1 --parallel-threads 2 --out profile.json
    python benchmarks/step_stall.py /tmp/steps.jsonl --profile profile.json [--role colocated] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mm_serve.planner.fit import fit_profile_file  # noqa: E402
from mm_serve.planner.latency_model import LatencyModel, ParallelConfig  # noqa: E402

BANDS = ((1, 4), (5, 10), (11, 20), (21, 1 << 20))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log", type=Path, help="a step log (MM_SERVE_STEP_LOG)")
    parser.add_argument("--profile", type=Path, required=True, help="mm-serve profile of the model on this machine")
    parser.add_argument("--role", default="colocated", help="whose steps: colocated (default) or decode")
    parser.add_argument("--threads", type=int, default=None,
                        help="the worker's torch threads, a profiled degree (default: 2 for colocated, else 1)")
    args = parser.parse_args()
    if args.threads is None:
        args.threads = 2 if args.role == "colocated" else 1
    if args.threads < 1:
        sys.exit(f"error: --threads must be at least 1, got {args.threads}")
    for path, what in ((args.log, "step log"), (args.profile, "profile")):
        if not path.is_file():
            sys.exit(f"error: no {what} at {path}")
    fit = fit_profile_file(args.profile)
    model = LatencyModel(fit.shape, fit.hardware)
    if args.threads > 1 and args.threads not in model.hardware.tensor_parallel:
        sys.exit(f"error: {args.profile} has no points on {args.threads} threads (mm-serve profile --parallel-threads)")
    decode = model.decode_timing(ParallelConfig(args.threads, 1))
    steps = []
    lines = args.log.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if number == len(lines):  # cut by a short write (a full disk): the log ends there
                print(f"warning: {args.log} line {number}, the last, is cut short; left out", file=sys.stderr)
                continue
            sys.exit(f"error: {args.log} line {number} is not JSON")
        if row.get("role") == args.role and row.get("kind") == "decode" and row.get("requests", 0) > 0:
            batch, context = int(row["requests"]), int(row["tokens"])
            steps.append((batch, float(row["seconds"]), float(row["cpu_seconds"]), decode.step_time(batch, context)))
    if not steps:
        sys.exit(f"error: no decode step of role {args.role} in {args.log}")
    print(f"{len(steps)} decode steps of {args.role}, profile {args.profile} on {args.threads} thread(s)")
    timed_cpu = any(s[2] > 0 for s in steps)  # a decode worker reports no CPU time (its step is a period)
    cpu_head = f" {'cpu s':>8}" if timed_cpu else ""
    print(f"{'batch':>9} {'steps':>6} {'wall s':>8}{cpu_head} {'profiled s':>10} {'wall/prof':>9}"
          + (f" {'cpu/prof':>8}" if timed_cpu else ""))
    for low, high in BANDS:
        band = [s for s in steps if low <= s[0] <= high]
        if band:
            wall, cpu, prof = (sum(s[i] for s in band) for i in (1, 2, 3))
            label = f"{low}-{high}" if high < 1 << 20 else f"{low}+"
            print(f"{label:>9} {len(band):>6} {wall:>8.2f}" + (f" {cpu:>8.2f}" if timed_cpu else "")
                  + f" {prof:>10.2f} {wall / prof:>9.2f}" + (f" {cpu / prof:>8.2f}" if timed_cpu else ""))
    batches = np.array([s[0] for s in steps], dtype=float)
    excess = np.array([s[1] - s[3] for s in steps])
    (a, b), *_ = np.linalg.lstsq(np.vstack([np.ones_like(batches), batches]).T, excess, rcond=None)
    print(f"wall - profiled = {a * 1e3:.2f} ms + {b * 1e3:.3f} ms x batch (least squares over the {len(steps)} steps)")


if __name__ == "__main__":
    main()
