"""Where the cores go under load: CPU seconds per delivered token, by process and by function.

Starts ``mm-serve serve`` (``--config``, ``--model``, ``--mode``), warms it with a few
requests, then sends ``mm-serve bench``'s workload (``--workload``) open-loop at ``--rate``
requests/s (``--num-requests`` requests, Poisson) from this process, and reads the user +
system CPU time of every process over the run: the API process, each worker (pids from
``/internal/stats``), any other child of the server, and this benchmark client itself
(only the sending and reading; the request bodies are built before the clock starts).
It prints CPU seconds, CPU milliseconds per delivered output token, the share of the
total and the cores each kept busy, and the run's SLO attainment, so that "the service
loses under load what the engine gains" can be put in numbers.

With ``--py-spy`` each server process is also sampled by py-spy (``--py-spy-rate``
samples/s, non-blocking, Python frames only) for the length of the run and the top
functions by self time are printed per process (the raw stacks are kept in ``--out``;
``py-spy``'s own CPU is counted in a row of its own). ``server total`` leaves out the
client and the profilers. A worker that restarts during the run makes it fail (its CPU
would be lost): run again. Not part of ``make test``. Usage::

    make bench-models
    python benchmarks/cpu_profile.py --config configs/default.yaml --model out/bench-llama \\
        --workload chatbot --rate 4 --num-requests 200 [--mode colocated] [--py-spy] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from mm_serve.bench.client import Endpoint, run_load  # noqa: E402
from mm_serve.bench.launch import LocalServer  # noqa: E402
from mm_serve.bench.metrics import summarize  # noqa: E402
from mm_serve.bench.process_cpu import (  # noqa: E402
    cpu_seconds,
    cpu_table,
    descendants,
    format_cpu_table,
    top_functions,
)
from mm_serve.bench.requests import RequestFactory  # noqa: E402
from mm_serve.bench.runner import LoadRunner, LoadSpec  # noqa: E402
from mm_serve.ground.slo import SLO  # noqa: E402
from mm_serve.models.registry import load_model_config  # noqa: E402
from mm_serve.workloads import make_workload  # noqa: E402

CLIENT = "bench client"


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--model", default="out/bench-llama", help="checkpoint directory (make bench-models)")
    p.add_argument("--mode", choices=["disaggregated", "colocated"], help="override the config's mode")
    p.add_argument("--workload", default="chatbot", help="an mm-serve bench workload")
    p.add_argument("--rate", type=float, required=True, help="requests/s (e.g. the goodput)")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=1.0, help="TTFT SLO, s (for the attainment shown)")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="TPOT SLO, s")
    p.add_argument("--py-spy", action="store_true", help="also sample every server process with py-spy")
    p.add_argument("--py-spy-rate", type=int, default=50, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=12, help="functions shown per process")
    p.add_argument("--out", help="directory for the server log and py-spy stacks (default: a temp dir)")
    args = p.parse_args(argv)
    if not args.rate > 0 or args.num_requests < 1:
        p.error("--rate must be > 0 and --num-requests >= 1")
    return args


def _server_processes(server: LocalServer) -> dict[str, int]:
    """Name -> pid: ``api`` (the server process), each worker by role and index, then other children."""
    assert server.pid is not None
    stats = httpx.get(f"{server.url}/internal/stats", timeout=30.0, trust_env=False).json()
    procs = {"api": server.pid}
    procs |= {name: int(s["pid"]) for name, s in sorted(stats.items()) if s.get("pid")}
    known = set(procs.values())
    for pid, cmd in descendants(server.pid).items():
        if pid not in known:
            label = "resource tracker" if "resource_tracker" in cmd else f"child {pid}"
            procs[label] = pid
    return procs


def _start_py_spy(procs: dict[str, int], rate: int, out: Path) -> dict[str, subprocess.Popen[bytes]]:
    """One ``py-spy record`` per server process, until SIGINT (then it writes its stacks)."""
    beside = Path(sys.executable).with_name("py-spy")
    exe = str(beside) if beside.is_file() else shutil.which("py-spy")
    if exe is None:
        raise SystemExit("py-spy is not installed (pip install py-spy, or `make install` for the dev extra)")
    spies = {}
    for name, pid in procs.items():
        if name.startswith(("child", "resource")):
            continue
        path = out / f"py-spy-{name}.txt"
        spies[name] = subprocess.Popen(
            [exe, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw", "--nonblocking", "-o", str(path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return spies


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="mm-serve-cpu-"))
    out.mkdir(parents=True, exist_ok=True)
    shape = load_model_config(Path(args.model))
    image_tokens = shape.vision.num_image_tokens if shape.vision else 0
    image_size = shape.vision.image_size if shape.vision else 336
    workload = make_workload(args.workload, image_tokens, shape.text.max_position_embeddings)
    slo = SLO(args.slo_ttft, args.slo_tpot)
    with LocalServer(out / "server.log", args.config, args.model, args.mode) as server:
        factory = RequestFactory(server.served_model_name, "chat", Path(args.model), image_size)
        endpoint = Endpoint(server.url, factory.path)
        runner = LoadRunner(endpoint, factory, LoadSpec(workload, args.seed, num_requests=args.num_requests), slo, 0.9)
        runner.unloaded(4)  # warm-up: first requests pay one-time costs
        procs = _server_processes(server)
        plan = runner.plan_at(args.rate)  # bodies built before the clock starts
        spies = _start_py_spy(procs, args.py_spy_rate, out) if args.py_spy else {}
        measuring = {CLIENT: os.getpid()} | {f"py-spy {k}": p.pid for k, p in spies.items()}
        before = cpu_seconds(procs | measuring)
        t0 = time.perf_counter()
        result = asyncio.run(run_load(endpoint, plan))
        wall_s = time.perf_counter() - t0
        after = cpu_seconds(procs | measuring)
        for spy in spies.values():
            spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
            spy.wait(timeout=60)
    run = summarize(result.records, args.rate, slo)
    tokens = sum(r.output_tokens for r in result.records if r.ok)
    print(f"{args.workload} at {args.rate:g} req/s, {len(plan)} requests ({run.num_ok} ok), {tokens} output "
          f"tokens in {wall_s:.1f} s; attainment {100 * run.attainment:.1f} % (TTFT {args.slo_ttft:g} s, "
          f"TPOT {1e3 * args.slo_tpot:g} ms); TTFT p90 {run.ttft.p90:.3f} s, TPOT p90 {1e3 * run.tpot.p90:.1f} ms")
    try:
        print(format_cpu_table(cpu_table(before, after, tokens, frozenset(measuring)), wall_s))
    except ValueError as exc:
        print(f"cpu_profile: {exc}", file=sys.stderr)
        return 1
    for name in spies:
        path = out / f"py-spy-{name}.txt"
        if not path.is_file():
            print(f"\n{name}: py-spy wrote nothing (permissions? see `py-spy record --help`)")
            continue
        total, rows = top_functions(path.read_text(), args.top)
        print(f"\n{name}: {total} samples at {args.py_spy_rate}/s (busy threads only); self % / inclusive %")
        for r in rows:
            print(f"  {100 * r.self_share:5.1f} {100 * r.inclusive_share:5.1f}  {r.function}")
    print(f"\nlogs and stacks in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
