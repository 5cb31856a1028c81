"""Does a worst-case legal stop list slow other streams? Short streamed completions' TTFT and TPOT on the
embedded model, alone and while a call with the most stop strings the server takes (``api.max_stop_strings``
of ``api.max_stop_chars`` characters together) and ``n`` = 16 streams beside them, in one run.

    python benchmarks/stop_list_interference.py [--probes 12] [--out /tmp/stoplist]

Prints the medians alone, beside the same n = 16 call without stop strings (the control: what sharing the
decode batch costs) and beside it with the stop list, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import httpx

from mm_serve.bench.launch import LocalServer
from mm_serve.config import APIConfig

PROBE = {"model": "bench", "prompt": "a purple circle and", "max_tokens": 32, "temperature": 0, "stream": True,
         "ignore_eos": True}


def probe(url: str) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds of one short streamed completion."""
    start = time.perf_counter()
    stamps = []
    with httpx.stream("POST", f"{url}/v1/completions", json=PROBE, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                stamps.append(time.perf_counter())
    ttft = stamps[0] - start
    return ttft, (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)


def heavy_body(with_stops: bool) -> dict:
    """``n`` = 16 choices to the end of the context, with the worst-case legal stop list or none (the control)."""
    api = APIConfig()
    each = api.max_stop_chars // api.max_stop_strings
    stops = [f"{i:04d}" + "Q" * (each - 4) for i in range(api.max_stop_strings)]  # never generated
    return {"model": "bench", "prompt": "a purple circle and", "n": 16, "temperature": 1.0,  # max_tokens: the context
            "stream": True, "ignore_eos": True, **({"stop": stops} if with_stops else {})}


def beside(url: str, probes: int, with_stops: bool) -> list[tuple[float, float]]:
    """Probes while :func:`heavy_body` calls stream one after another.

    Raises:
        SystemExit: the heavy calls were refused or did not stream during the probes.
    """
    done = threading.Event()
    lines: list[int] = []

    def heavy() -> None:
        while not done.is_set():
            with httpx.stream("POST", f"{url}/v1/completions", json=heavy_body(with_stops), timeout=600) as response:
                if response.status_code != 200:
                    response.read()
                    print(f"the heavy call was refused: HTTP {response.status_code} {response.text[:300]}")
                    return
                for _ in response.iter_lines():
                    lines.append(1)
                    if done.is_set():
                        return

    thread = threading.Thread(target=heavy, daemon=True)
    thread.start()
    time.sleep(2.0)  # its 16 choices are decoding
    before = len(lines)
    out = [probe(url) for _ in range(probes)]
    streamed = len(lines) - before
    done.set()
    thread.join(60)
    if streamed < 10:
        raise SystemExit("the heavy call was not streaming beside the probes: no comparison")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probes", type=int, default=12, help="short completions measured in each phase")
    parser.add_argument("--out", default="/tmp/stoplist", help="folder for the server log")
    args = parser.parse_args()
    with LocalServer(Path(args.out) / "server.log", model="embedded", extra_args=("--no-admission",)) as server:
        url = server.url
        probe(url)  # warm
        alone = [probe(url) for _ in range(args.probes)]
        control = beside(url, args.probes, with_stops=False)
        loaded = beside(url, args.probes, with_stops=True)
    rows = (("alone", alone), ("beside n=16, no stop", control), ("beside n=16, stop list", loaded))
    for name, values in rows:
        print(f"{name:>22}: TTFT p50 {statistics.median(v[0] for v in values) * 1e3:7.1f} ms, "
              f"TPOT p50 {statistics.median(v[1] for v in values) * 1e3:6.2f} ms")
    for i, what in ((0, "TTFT"), (1, "TPOT")):
        def p50(values: list[tuple[float, float]], i: int = i) -> float:
            return statistics.median(v[i] for v in values)
        print(f"{what}: beside the stop list / alone {p50(loaded) / p50(alone):.2f}x; "
              f"/ beside the same call without it {p50(loaded) / p50(control):.2f}x")


if __name__ == "__main__":
    main()
