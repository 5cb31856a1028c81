"""Admission under bursts with photos on an otherwise idle server: 429s and time to first token, this
checkout against another git revision, alternated round by round.

    python benchmarks/photo_burst.py --baseline-rev 74d5ec9 --rounds 2 --bursts 6

Each round starts a fresh ``mm-serve serve --mode colocated`` (the embedded model, default SLOs: the standard
tier's TTFT 4 s) from each tree in turn and sends it ``--bursts`` bursts, a second apart, of 16 concurrent
streamed chat calls: every fourth carries a 4000x3000 JPEG (random pixels, ~14 MB as a data URI), the
others a 64x48 PNG, each with its own ``cache_salt``. Prints per tree the calls refused (429) and the
photos' time to first token, then the totals. The baseline runs from a temporary ``git worktree`` with
this venv's Python (as ``benchmarks/start_time.py``).
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from start_time import checkout_trees, colocated_server  # noqa: E402

CALLS = 16
PHOTO_EVERY = 4


def _data_uri(image: Image.Image, fmt: str) -> str:
    buffer = io.BytesIO()
    image.save(buffer, fmt, quality=95)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def _call(url: str, model: str, image: str, out: list[tuple[bool, int, float | None]], photo: bool) -> None:
    body = {"model": model, "stream": True, "max_tokens": 24, "cache_salt": uuid.uuid4().hex,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is in the picture?"},
                                                      {"type": "image_url", "image_url": {"url": image}}]}]}
    started, first = time.monotonic(), None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if first is None and line.startswith("data:") and response.status_code == 200:
                first = time.monotonic() - started
    out.append((photo, response.status_code, first))


def run_tree(tree: Path, bursts: int, photo: str, small: str) -> list[tuple[bool, int, float | None]]:
    """Start a colocated server from ``tree``, send the bursts, stop it; (photo?, status, TTFT) per call."""
    with colocated_server(tree) as url:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        out: list[tuple[bool, int, float | None]] = []
        for _ in range(bursts):
            threads = [threading.Thread(target=_call, args=(url, model, photo if i % PHOTO_EVERY == 0 else small, out,
                                                            i % PHOTO_EVERY == 0)) for i in range(CALLS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            time.sleep(1.0)
        return out


def _summary(calls: list[tuple[bool, int, float | None]]) -> str:
    refused = sum(status == 429 for _, status, _ in calls)
    ttfts = [t for is_photo, status, t in calls if is_photo and status == 200 and t is not None]
    photos = f"photos' TTFT median {statistics.median(ttfts):.2f} s, max {max(ttfts):.2f} s" if ttfts else "no photo served"
    return f"{refused} of {len(calls)} refused; {photos}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bursts", type=int, default=6)
    parser.add_argument("--baseline-rev", help="git revision to compare against (omit: this checkout only)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    photo = _data_uri(Image.fromarray(rng.integers(0, 255, (3000, 4000, 3), dtype=np.uint8)), "JPEG")
    small = _data_uri(Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)), "PNG")
    with checkout_trees(args.baseline_rev) as trees:
        calls: dict[str, list[tuple[bool, int, float | None]]] = {name: [] for name in trees}
        for round_ in range(1, args.rounds + 1):
            for name, tree in (trees.items() if round_ % 2 else reversed(trees.items())):
                got = run_tree(tree, args.bursts, photo, small)
                calls[name] += got
                print(f"round {round_}, {name}: {_summary(got)}", flush=True)
    for name, got in calls.items():
        print(f"{name}: {_summary(got)}")


if __name__ == "__main__":
    main()
