"""Seconds from launching ``mm-serve serve`` to its first ``/health`` 200, this checkout against another
git revision, alternated round by round (the machine's speed drifts: compare within a round).

    python benchmarks/start_time.py --model out/bench-llava --rounds 5 --baseline-rev HEAD~3

Each start runs with ``--no-auto-placement`` (the config's placement: no profiling) and is stopped with
SIGINT once healthy. The baseline runs from a temporary ``git worktree`` of the revision with this
venv's Python. Prints each round's two times, then medians, ranges and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def checkout_trees(baseline_rev: str | None) -> Iterator[dict[str, Path]]:
    """This checkout (``"this checkout"``) and, with ``baseline_rev``, a temporary ``git worktree`` of that
    revision under its name, removed on exit."""
    with tempfile.TemporaryDirectory(prefix="baseline-") as scratch:
        trees = {"this checkout": ROOT}
        base = Path(scratch) / "baseline"
        if baseline_rev:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), baseline_rev],
                           check=True)
            trees[baseline_rev] = base
        try:
            yield trees
        finally:
            if baseline_rev:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)


@contextmanager
def serving(tree: Path, args: list[str], timeout_s: float = 300.0) -> Iterator[tuple[str, float]]:
    """``mm-serve serve ARGS`` run from ``tree`` on a free port, healthy: gives its URL and the seconds from
    launch to its first ``/health`` 200 (polled every 20 ms); stops it with SIGINT on exit.

    Raises:
        RuntimeError: it exited (its stderr's tail said), or was not healthy within ``timeout_s``.
    """
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(tree))
    with tempfile.TemporaryFile() as stderr:  # a file, not a pipe: a pipe nobody reads would stall the server
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "mm_serve.cli.main", "serve", *args, "--port", str(port)],
                                cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            while True:
                if proc.poll() is not None:
                    stderr.seek(0)
                    raise RuntimeError(f"the server in {tree} exited: {stderr.read().decode()[-2000:]}")
                if time.monotonic() - started > timeout_s:
                    raise RuntimeError(f"the server in {tree} was not healthy within {timeout_s:g} s")
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.02)
            yield url, time.monotonic() - started
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)


@contextmanager
def colocated_server(tree: Path) -> Iterator[str]:
    """``mm-serve serve --mode colocated`` (the embedded model) from ``tree``, healthy (:func:`serving`): its URL."""
    with serving(tree, ["--mode", "colocated"]) as (url, _):
        yield url


def time_start(tree: Path, model: str, timeout_s: float = 300.0) -> float:
    """Seconds from launch to /health 200 of ``mm-serve serve`` run from ``tree`` (:func:`serving`); the server
    is then stopped.

    Raises:
        RuntimeError: it exited, or was not healthy within ``timeout_s``.
    """
    with serving(tree, ["--model", model, "--no-auto-placement"], timeout_s) as (_, seconds):
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded", help="checkpoint directory, or embedded")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline-rev", help="git revision to compare against (omit: this checkout only)")
    args = parser.parse_args()
    model = args.model if args.model == "embedded" else str(Path(args.model).resolve())
    with checkout_trees(args.baseline_rev) as trees:
        times: dict[str, list[float]] = {name: [] for name in trees}
        for round_ in range(1, args.rounds + 1):
            for name, tree in (trees.items() if round_ % 2 else reversed(trees.items())):
                times[name].append(time_start(tree, model))
            print(f"round {round_}: " + ", ".join(f"{name} {t[-1]:.2f} s" for name, t in times.items()), flush=True)
    for name, t in times.items():
        print(f"{name}: median {statistics.median(t):.2f} s [{min(t):.2f}, {max(t):.2f}] over {len(t)} starts")
    if args.baseline_rev:
        this, base_t = times["this checkout"], times[args.baseline_rev]
        ratios = [a / b for a, b in zip(this, base_t, strict=True)]
        print(f"this checkout / {args.baseline_rev}: median {statistics.median(ratios):.2f} "
              f"[{min(ratios):.2f}, {max(ratios):.2f}]")


if __name__ == "__main__":
    main()
