"""Does a worst-case legal stop list slow other streams? Short streamed completions' TTFT and TPOT on the
embedded model, alone and while a call with the most stop strings the server takes (``api.max_stop_strings``
of ``api.max_stop_chars`` characters together) and ``n`` = 16 streams beside them, in one run.

    python benchmarks/stop_list_interference.py [--probes 12] [--out /tmp/stoplist]

Prints the medians alone, beside the same n = 16 call without stop strings (the control: what sharing the
decode batch costs) and beside it with the stop list, and their ratios.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mm_serve.bench.interference import Timing, beside, median, probe
from mm_serve.bench.launch import LocalServer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probes", type=int, default=12, help="short completions measured in each phase")
    parser.add_argument("--out", default="/tmp/stoplist", help="folder for the server log")
    args = parser.parse_args()
    with LocalServer(Path(args.out) / "server.log", model="embedded", extra_args=("--no-admission",)) as server:
        url = server.url
        probe(url, "bench")  # warm
        alone = [probe(url, "bench") for _ in range(args.probes)]
        control = beside(url, "bench", args.probes, with_stops=False)
        loaded = beside(url, "bench", args.probes, with_stops=True)
    rows: tuple[tuple[str, list[Timing]], ...] = (
        ("alone", alone), ("beside n=16, no stop", control), ("beside n=16, stop list", loaded))
    for name, values in rows:
        print(f"{name:>22}: TTFT p50 {median(values, 0) * 1e3:7.1f} ms, TPOT p50 {median(values, 1) * 1e3:6.2f} ms")
    for i, what in ((0, "TTFT"), (1, "TPOT")):
        print(f"{what}: beside the stop list / alone {median(loaded, i) / median(alone, i):.2f}x; "
              f"/ beside the same call without it {median(loaded, i) / median(control, i):.2f}x")


if __name__ == "__main__":
    main()
