"""Does a call at the per-request limits slow other streams? Short streamed completions' TTFT and TPOT on the
embedded model, alone and while a call with the most stop strings the server takes (``api.max_stop_strings``
of ``api.max_stop_chars`` characters together) and the most log-probabilities streams beside them: with one
choice, and with ``api.max_n`` (16), in one run.

    python benchmarks/stop_list_interference.py [--probes 12] [--out /tmp/stoplist]

Prints the medians alone; beside the stop-list call (n = 1); beside an n = 16 call without stop strings (the
control: what 16 more sequences in the decode batch cost); beside the n = 16 call with the stop list; and
their ratios.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mm_serve.bench.interference import Timing, beside, heavy_body, median, probe
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
        one = beside(url, "bench", args.probes, heavy_body("bench", n=1))
        control = beside(url, "bench", args.probes, heavy_body("bench", with_stops=False))
        loaded = beside(url, "bench", args.probes, heavy_body("bench"))
    rows: tuple[tuple[str, list[Timing]], ...] = (
        ("alone", alone), ("beside n=1, stop list", one), ("beside n=16, no stop", control),
        ("beside n=16, stop list", loaded))
    for name, values in rows:
        print(f"{name:>22}: TTFT p50 {median(values, 0) * 1e3:7.1f} ms, TPOT p50 {median(values, 1) * 1e3:6.2f} ms")
    for i, what in ((0, "TTFT"), (1, "TPOT")):
        print(f"{what}: beside the n=1 stop-list call / alone {median(one, i) / median(alone, i):.2f}x; "
              f"beside n=16 with the stop list / alone {median(loaded, i) / median(alone, i):.2f}x, "
              f"/ beside the same call without it {median(loaded, i) / median(control, i):.2f}x")


if __name__ == "__main__":
    main()
