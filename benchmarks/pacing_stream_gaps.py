"""Token gaps of one stream from a paced decode worker: idle, beside a busy loop on its core, and after.

Starts ``mm-serve serve`` (on a free port) on a config whose decode worker paces (``scheduler.decode_step_pacing`` or
``decode_step_interval_ms``, its cores pinned by ``compute.decode_cpus``), streams one chat answer of
``--tokens`` tokens (``ignore_eos``), and after ``--quiet`` content deltas starts a busy loop pinned to
the decode worker's first core, stopped ``--busy`` deltas later. The script itself runs off the decode
worker's cores, as a remote client would. Prints the median, mean and largest
gap between content deltas in each phase (milliseconds). An unloaded service should decode at full
speed (the front end keeps off the paced decode worker's cores: ``mm_serve/cluster/front_end_cores.py``); beside
the loop the gaps should be the pacing's (a fraction of the request's tier TPOT SLO).

Usage::

    python benchmarks/pacing_stream_gaps.py --config benchmarks/configs/paced_1p1d.yaml [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from mm_serve.bench.launch import LocalServer


def stream_gaps(url: str, model: str, tokens: int, quiet: int, busy: int, core: int) -> dict[str, list[float]]:
    """Seconds between content deltas of one stream, by phase (``idle``, ``busy loop``, ``after``)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story"}], "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    times: list[float] = []
    loop: subprocess.Popen[bytes] | None = None
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    times.append(time.monotonic())
                if len(times) == quiet and loop is None:
                    loop = subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", "while True: pass"])
                if len(times) == quiet + busy and loop is not None:
                    loop.kill()
                    loop.wait()
                    loop = None
    finally:
        if loop is not None:
            loop.kill()
            loop.wait()
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"idle": gaps[:quiet - 1], "busy loop": gaps[quiet:quiet + busy - 1], "after": gaps[quiet + busy:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a service config whose decode worker paces, its cores pinned")
    parser.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--quiet", type=int, default=60, help="content deltas before the busy loop starts")
    parser.add_argument("--busy", type=int, default=100, help="content deltas the busy loop runs for")
    args = parser.parse_args()
    cores = (yaml.safe_load(Path(args.config).read_text()) or {}).get("compute", {}).get("decode_cpus") or []
    if not cores:
        raise SystemExit("the config must pin the decode worker (compute.decode_cpus)")
    with tempfile.TemporaryDirectory() as tmp, LocalServer(Path(tmp) / "server.log", config=args.config,
                                                           model=args.model) as server:
        # this client off the decode cores (after the server started, which must not inherit it): a client is
        # remote in a deployment, and here its per-token parsing on the decode core would be "another process"
        rest = os.sched_getaffinity(0) - {int(c) for c in cores}
        if rest:
            os.sched_setaffinity(0, rest)
        phases = stream_gaps(server.url, server.served_model_name, args.tokens, args.quiet, args.busy, int(cores[0]))
    print(f"{'phase':<10} {'gaps':>5} {'median ms':>10} {'mean ms':>8} {'max ms':>7}")
    for name, gaps in phases.items():
        if gaps:
            print(f"{name:<10} {len(gaps):>5} {statistics.median(gaps) * 1e3:>10.1f} "
                  f"{statistics.mean(gaps) * 1e3:>8.1f} {max(gaps) * 1e3:>7.1f}")


if __name__ == "__main__":
    main()
