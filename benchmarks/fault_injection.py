"""Fault injection: streaming traffic while workers are SIGKILLed and SIGSTOPped.

Starts ``mm-serve serve`` (a real subprocess), records the greedy output of every
request of a fixed mix (image and text chat requests) without faults, then drives
``--concurrency`` streaming clients for ``--duration`` seconds while a fault thread
SIGKILLs a random worker every 10-15 s and, once, SIGSTOPs one for longer than
``fault.heartbeat_timeout_s``. Every stream is classified:

* complete: 200, one ``[DONE]``, a finish reason, no error event, text equal to the no-fault run;
* differing: complete but another text (truncated / duplicated when it is a strict
  prefix / extension of the no-fault text);
* error: a 503 or an SSE error event (then ``[DONE]``): a clear failure;
* lost: no terminal state (the client's timeout, 130 s, passed).

Then prints pages and ring slots in use and ``/dev/shm`` segments before and after, and
whether every worker is ready at the end. Usage::

    python benchmarks/fault_injection.py [--model embedded|DIR] [--layouts 1p1d,2p1d] [--duration 120]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from mm_serve.models.builder import build_llava  # noqa: E402
from mm_serve.models.named_models import resolve_model  # noqa: E402
from tests.api.server_process import ServerProcess, data_uri  # noqa: E402
from tests.factories import gradient_image  # noqa: E402

HEARTBEAT_S = 3.0
CLIENT_TIMEOUT_S = 130.0


def _model(name: str) -> Path:
    if name == "tiny":
        out = Path(tempfile.gettempdir()) / "mm_serve_bench_tiny_llava"
        return out if (out / "config.json").is_file() else build_llava(out)
    return resolve_model(name)


def request_mix(n: int) -> list[dict[str, Any]]:
    """``n`` chat bodies: every other one with an image, greedy, 24-72 new tokens."""
    bodies = []
    for i in range(n):
        text = f"Request {i}: describe what you see and what it could mean, in detail."
        content: Any = text
        if i % 2 == 0:
            content = [{"type": "image_url", "image_url": {"url": data_uri(gradient_image(40 + i % 17, 36, i))}},
                       {"type": "text", "text": text}]
        bodies.append({"model": "bench", "messages": [{"role": "user", "content": content}],
                       "max_tokens": 24 + (i * 7) % 49, "temperature": 0, "ignore_eos": True})
    return bodies


def stream(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed chat completion: its text, finish reason, error and framing."""
    out: dict[str, Any] = {"status": None, "text": "", "finish": None, "error": None, "done": 0}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body | {"stream": True},
                          timeout=CLIENT_TIMEOUT_S) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                r.read()
                out["error"] = r.text[:200]
                return out
            for line in r.iter_lines():
                if not line:
                    continue
                if line == "data: [DONE]":
                    out["done"] += 1
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = chunk["error"]["message"]
                    continue
                for choice in chunk["choices"]:
                    out["text"] += choice["delta"].get("content") or ""
                    out["finish"] = choice["finish_reason"] or out["finish"]
    except httpx.TimeoutException:
        out["status"] = "lost"
    except httpx.HTTPError as exc:
        out["status"] = f"transport: {exc!r}"
    return out


def classify(result: dict[str, Any], expected: str) -> str:
    if result["status"] == "lost":
        return "lost"
    if result["error"] is not None:
        return "error" if result["done"] == 1 or result["status"] != 200 else "error without [DONE]"
    if result["status"] != 200 or result["done"] != 1 or result["finish"] is None:
        return "truncated"
    if result["text"] == expected:
        return "complete"
    if expected.startswith(result["text"]):
        return "truncated"
    if result["text"].startswith(expected):
        return "duplicated"
    return "differing"


def worker_pids(url: str) -> dict[str, int]:
    stats = httpx.get(f"{url}/internal/stats", timeout=30).json()
    return {name: int(s["pid"]) for name, s in stats.items()}


def usage(url: str) -> tuple[int, int]:
    """(KV pages used, ring slots used) over every worker."""
    stats = httpx.get(f"{url}/internal/stats", timeout=30).json()
    return sum(s["kv_pages_used"] for s in stats.values()), sum(s["ring_slots_used"] for s in stats.values())


def instance_prefix(pid: int) -> str:
    """``mmsrv-<instance>`` of the service whose front end is ``pid`` (it maps its rings)."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        name = line.rsplit("/", 1)[-1]
        if "/dev/shm/mmsrv-" in line:
            return "-".join(name.split("-")[:2])
    raise RuntimeError(f"process {pid} maps no mmsrv ring segment")


def shm_count(prefix: str) -> int:
    """Segments in /dev/shm of one service instance (other instances on the machine not counted)."""
    return sum(1 for name in os.listdir("/dev/shm") if name.startswith(prefix + "-"))


def inject_faults(url: str, stop: threading.Event, duration: float, log: list[str], rng: random.Random) -> None:
    """Until ``stop`` or ``duration`` seconds: SIGKILL a random worker every 10-15 s, and once,
    past half-time, SIGSTOP one for longer than the heartbeat timeout."""
    start = time.monotonic()
    stopped_once = False
    while not stop.wait(rng.uniform(10.0, 15.0)) and time.monotonic() - start < duration:
        try:
            pids = worker_pids(url)
        except httpx.HTTPError:
            continue
        if not pids:
            continue
        name = rng.choice(sorted(pids))
        elapsed = time.monotonic() - start
        if not stopped_once and elapsed > duration / 2:
            stopped_once = True
            os.kill(pids[name], signal.SIGSTOP)
            log.append(f"{elapsed:6.1f} s  SIGSTOP {name} (pid {pids[name]}) for {HEARTBEAT_S + 3:.0f} s")
            stop.wait(HEARTBEAT_S + 3.0)
            try:
                os.kill(pids[name], signal.SIGCONT)  # normally gone already: the supervisor killed it
            except ProcessLookupError:
                pass
            continue
        os.kill(pids[name], signal.SIGKILL)
        log.append(f"{elapsed:6.1f} s  SIGKILL {name} (pid {pids[name]})")


def run_layout(model: Path, prefill: int, decode: int, duration: float, concurrency: int, seed: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="mm-serve-fault-bench-"))
    config = tmp / "fault.yaml"
    config.write_text(f"fault:\n  heartbeat_timeout_s: {HEARTBEAT_S}\n  max_restarts: 100\n")
    server = ServerProcess(model, "--config", str(config), "--prefill-workers", str(prefill),
                           "--decode-workers", str(decode), "--served-model-name", "bench", log_dir=tmp)
    try:
        server.wait_ready(600)
        bodies = request_mix(24)
        with ThreadPoolExecutor(concurrency) as pool:
            expected = [r["text"] for r in pool.map(lambda b: stream(server.url, b), bodies)]
        pages_before, slots_before = usage(server.url)
        prefix = instance_prefix(server.proc.pid)
        shm_serving = shm_count(prefix)
        stop = threading.Event()
        log: list[str] = []
        rng = random.Random(seed)
        faults = threading.Thread(target=inject_faults, args=(server.url, stop, duration, log, rng), daemon=True)
        results: Counter[str] = Counter()
        errors: Counter[str] = Counter()
        deadline = time.monotonic() + duration
        sent = [0]
        lock = threading.Lock()

        def client(k: int) -> None:
            i = k
            while time.monotonic() < deadline:
                with lock:
                    sent[0] += 1
                result = stream(server.url, bodies[i % len(bodies)])
                kind = classify(result, expected[i % len(bodies)])
                with lock:
                    results[kind] += 1
                    if result["error"] is not None:
                        errors[str(result["error"])[:160]] += 1
                i += concurrency

        faults.start()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(client, range(concurrency)))
        stop.set()
        faults.join()
        ready_deadline = time.monotonic() + 120
        while time.monotonic() < ready_deadline:
            health = httpx.get(f"{server.url}/health", timeout=30).json()
            if health["status"] == "ok":
                break
            time.sleep(0.5)
        time.sleep(1.0)
        pages_after, slots_after = usage(server.url)
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        shm_end = shm_count(prefix)
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    counters = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
                if line.startswith(("mm_serve_worker_restarts_total", "mm_serve_request_migrations_total",
                                    "mm_serve_handoff_failures_total", "mm_serve_requests_failed_by_fault_total"))}
    return {
        "layout": f"{prefill}P{decode}D", "sent": sent[0], "results": results, "faults": log,
        "pages": (pages_before, pages_after), "slots": (slots_before, slots_after),
        "shm": (shm_serving, shm_end, shm_count(prefix)), "health": health, "counters": counters,
        "errors": errors,
    }


def report(r: dict[str, Any]) -> None:
    res = r["results"]
    print(f"\n== {r['layout']}: {r['sent']} streaming requests, faults:")
    for line in r["faults"]:
        print("   " + line)
    print(f"   complete with the no-fault text : {res['complete']}")
    print(f"   ended with an error (503/event) : {res['error']}")
    print(f"   error without [DONE]            : {res['error without [DONE]']}")
    print(f"   lost (no terminal state)        : {res['lost']}")
    print(f"   truncated / duplicated          : {res['truncated']} / {res['duplicated']}")
    print(f"   greedy output differing         : {res['differing']}")
    print(f"   KV pages used  before/after     : {r['pages'][0]} / {r['pages'][1]}")
    print(f"   ring slots used before/after    : {r['slots'][0]} / {r['slots'][1]}")
    s, e, a = r["shm"]
    print(f"   /dev/shm segments of the service: {s} serving at the start, {e} at the end, {a} after stop")
    print(f"   health at the end               : {r['health']['status']} {r['health']['workers']}")
    for name, value in sorted(r["counters"].items()):
        print(f"   {name:<56} {value:g}")
    for message, n in r["errors"].most_common():
        print(f"   error x{n}: {message}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="embedded (default), tiny, or a checkpoint directory")
    parser.add_argument("--layouts", default="1p1d,2p1d", help="comma-separated NpMd layouts")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of traffic per layout")
    parser.add_argument("--concurrency", type=int, default=4, help="streaming clients")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop the server
    model = _model(args.model)
    for layout in args.layouts.split(","):
        p, d = layout.lower().removesuffix("d").split("p")
        report(run_layout(model, int(p), int(d), args.duration, args.concurrency, args.seed))


if __name__ == "__main__":
    main()
