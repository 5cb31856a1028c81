"""API overhead and whole-service memory.

1. The API's own overhead: median time of a one-token chat completion through
   HTTP minus the median time of the same request submitted straight to the
   engine (same disaggregated workers, same process layout), i.e. what FastAPI,
   JSON, validation and the event-loop bridge add to TTFT.
2. Peak memory of the whole service (API process + every worker, RSS summed)
   while 32 streaming clients (a mix of image and text requests) run.

Usage: ``python benchmarks/api_overhead.py [--model embedded|DIR] [--repeats 30]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from mm_serve.config import load_config  # noqa: E402
from mm_serve.engine.engine_client import EngineClient  # noqa: E402
from mm_serve.models.builder import build_llava  # noqa: E402
from mm_serve.models.named_models import resolve_model  # noqa: E402
from mm_serve.runtime.sampling_params import SamplingParams  # noqa: E402
from tests.api.server_process import ServerProcess, data_uri  # noqa: E402
from tests.factories import gradient_image  # noqa: E402

PROMPT = "Describe a quiet lake at sunset in one sentence."


def _model(name: str) -> Path:
    try:
        return resolve_model(name)
    except ValueError:
        out = Path(tempfile.gettempdir()) / "mm_serve_bench_tiny_llava"
        return out if (out / "config.json").is_file() else build_llava(out)


def engine_ttft(model_dir: Path, repeats: int) -> float:
    """Median seconds from submit to the first token, straight to the engine (no HTTP)."""
    client = EngineClient(model_dir, load_config(None, {"model": str(model_dir)}))
    client.start()
    try:
        messages = [{"role": "user", "content": PROMPT}]
        inputs = client.inputs.process({"messages": messages})
        times = []
        for i in range(repeats + 3):
            start = time.perf_counter()
            state = client.submit(f"b{i}", inputs, SamplingParams(max_tokens=1, temperature=0.0))
            state.wait(60)
            if i >= 3:
                times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        client.shutdown()


def _tree_rss_bytes(pid: int) -> int:
    total = 0
    pids = [pid]
    while pids:
        p = pids.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
            pids.extend(int(c) for c in children)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def http_ttft_and_peak_rss(model_dir: Path, repeats: int) -> tuple[float, int, int]:
    """(median one-token HTTP latency, peak service RSS during 32 streams, idle RSS)."""
    with tempfile.TemporaryDirectory() as logs:
        server = ServerProcess(model_dir, log_dir=Path(logs))
        try:
            server.wait_ready()
            body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1,
                    "temperature": 0}
            times = []
            with httpx.Client(timeout=60) as http:
                for i in range(repeats + 3):
                    start = time.perf_counter()
                    http.post(f"{server.url}/v1/chat/completions", json=body).raise_for_status()
                    if i >= 3:
                        times.append(time.perf_counter() - start)
            idle = _tree_rss_bytes(server.proc.pid)
            peak = [idle]
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], _tree_rss_bytes(server.proc.pid))
                    time.sleep(0.05)

            def stream(i: int) -> None:
                content: object = f"Stream {i}: tell me a story."
                if i % 2:
                    content = [{"type": "image_url", "image_url": {"url": data_uri(gradient_image(200, 150, i))}},
                               {"type": "text", "text": "Describe the image."}]
                req = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 32,
                       "stream": True}
                with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=req, timeout=300) as r:
                    for _ in r.iter_lines():
                        pass

            sampler = threading.Thread(target=sample)
            sampler.start()
            with ThreadPoolExecutor(32) as pool:
                list(pool.map(stream, range(32)))
            stop.set()
            sampler.join()
            return statistics.median(times), peak[0], idle
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    model_dir = _model(args.model)
    offline = engine_ttft(model_dir, args.repeats)
    http, peak, idle = http_ttft_and_peak_rss(model_dir, args.repeats)
    print(f"model: {model_dir}")
    print(f"median TTFT, engine direct : {offline * 1000:7.2f} ms")
    print(f"median TTFT, through HTTP  : {http * 1000:7.2f} ms")
    print(f"API overhead               : {(http - offline) * 1000:7.2f} ms  (goal < 20 ms)")
    print(f"service RSS idle           : {idle / 2**20:7.1f} MiB")
    print(f"service RSS peak, 32 streams: {peak / 2**20:6.1f} MiB")


if __name__ == "__main__":
    main()
