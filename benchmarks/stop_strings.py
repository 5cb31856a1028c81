"""Cost of stop-string matching per streamed token: the detokenizer's Aho-Corasick matcher
(``mm_serve.runtime.stop_strings``) against the scan it replaced (every stop string searched, and every
prefix of every stop string tried against the text's tail, at each step), side by side in one run.

    python benchmarks/stop_strings.py [--tokens 2000] [--chars 128]

Prints microseconds per step for 1, 8, 64 and 512 stop strings of ``--chars`` characters each (none of
which occurs), over a text growing by a few characters a step, as a streamed answer does.
"""

from __future__ import annotations

import argparse
import functools
import random
import string
import time

from mm_serve.runtime.stop_strings import StopStrings


def naive_step(text: str, sent: int, stops: tuple[str, ...]) -> int:
    """The replaced scan: find any stop from ``sent - longest``, then the longest tail that is a stop's prefix."""
    longest = max(len(s) for s in stops)
    start = max(0, sent - longest)
    for stop in stops:
        text.find(stop, start)
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


def automaton_step(text: str, sent: int, matcher: StopStrings) -> int:
    matcher.first(text, max(0, sent - matcher.longest))
    return matcher.hold


def run(tokens: int, chars: int) -> None:
    rng = random.Random(0)
    words = ["the", "model", "serves", "images", "and", "text", "quickly", "today", "while", "decode", "runs"]
    pieces = [" " + rng.choice(words) for _ in range(tokens)]
    print(f"{'stop strings':>12} {'chars each':>10} {'scan us/step':>13} {'automaton us/step':>18} {'ratio':>7}")
    for count in (1, 8, 64, 512):
        stops = tuple("".join(rng.choice(string.ascii_uppercase) for _ in range(chars)) for _ in range(count))
        matcher = StopStrings(stops)
        timings = []
        steps = (functools.partial(naive_step, stops=stops), functools.partial(automaton_step, matcher=matcher))
        for step in steps:
            text, sent = "", 0
            start = time.perf_counter()
            for piece in pieces:
                text += piece
                sent = max(sent, len(text) - step(text, sent))
            timings.append((time.perf_counter() - start) / tokens * 1e6)
        print(f"{count:>12} {chars:>10} {timings[0]:>13.1f} {timings[1]:>18.1f} {timings[0] / timings[1]:>6.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000, help="steps (streamed tokens) per measurement")
    parser.add_argument("--chars", type=int, default=128, help="characters of each stop string")
    args = parser.parse_args()
    run(args.tokens, args.chars)


if __name__ == "__main__":
    main()
