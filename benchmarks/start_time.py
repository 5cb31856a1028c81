"""Seconds from launching ``mm-serve serve`` to its first ``/health`` 200, this checkout against another
git revision, alternated round by round (the machine's speed drifts: compare within a round).

    python benchmarks/start_time.py --model out/bench-llava --rounds 5 --baseline-rev HEAD~3

Each start runs with ``--no-auto-placement`` (the config's placement: no profiling) and is stopped with
SIGINT once healthy; with ``--first-structured S``, after one ``json_schema`` call sent S seconds after
it was healthy (its latency is printed too: the processes' grammar compilers are warmed in the
background once they are ready). The baseline runs from a temporary ``git worktree`` of the revision with this
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


def structured_call_s(url: str) -> float:
    """Seconds one chat call with a ``json_schema`` response format (16 tokens at most) takes at ``url``.

    Raises:
        httpx.HTTPStatusError: it was not answered 200.
    """
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    body = {"model": model, "messages": [{"role": "user", "content": "Reply in JSON."}], "max_tokens": 16,
            "response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}}
    started = time.monotonic()
    httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).raise_for_status()
    return time.monotonic() - started


def time_start(tree: Path, model: str, timeout_s: float = 300.0,
               structured_after_s: float | None = None) -> tuple[float, float | None]:
    """Seconds from launch to /health 200 of ``mm-serve serve`` run from ``tree`` (:func:`serving`), and with
    ``structured_after_s`` the seconds of a :func:`structured_call_s` sent that long after; the server is then
    stopped.

    Raises:
        RuntimeError: it exited, or was not healthy within ``timeout_s``.
    """
    with serving(tree, ["--model", model, "--no-auto-placement"], timeout_s) as (url, seconds):
        if structured_after_s is None:
            return seconds, None
        time.sleep(structured_after_s)
        return seconds, structured_call_s(url)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded", help="checkpoint directory, or embedded")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline-rev", help="git revision to compare against (omit: this checkout only)")
    parser.add_argument("--first-structured", type=float, metavar="S",
                        help="also time one json_schema call sent S seconds after the server is healthy")
    args = parser.parse_args()
    model = args.model if args.model == "embedded" else str(Path(args.model).resolve())
    with checkout_trees(args.baseline_rev) as trees:
        times: dict[str, list[float]] = {name: [] for name in trees}
        calls: dict[str, list[float]] = {name: [] for name in trees}
        for round_ in range(1, args.rounds + 1):
            for name, tree in (trees.items() if round_ % 2 else reversed(trees.items())):
                start_s, call_s = time_start(tree, model, structured_after_s=args.first_structured)
                times[name].append(start_s)
                if call_s is not None:
                    calls[name].append(call_s)
            print(f"round {round_}: " + ", ".join(
                f"{name} {t[-1]:.2f} s" + (f" (first structured call {calls[name][-1]:.3f} s)" if calls[name] else "")
                for name, t in times.items()), flush=True)
    for name, t in times.items():
        print(f"{name}: median {statistics.median(t):.2f} s [{min(t):.2f}, {max(t):.2f}] over {len(t)} starts")
        if calls[name]:
            c = calls[name]
            print(f"{name}: first structured call median {statistics.median(c):.3f} s [{min(c):.3f}, {max(c):.3f}]")
    if args.baseline_rev:
        this, base_t = times["this checkout"], times[args.baseline_rev]
        ratios = [a / b for a, b in zip(this, base_t, strict=True)]
        print(f"this checkout / {args.baseline_rev}: median {statistics.median(ratios):.2f} "
              f"[{min(ratios):.2f}, {max(ratios):.2f}]")


if __name__ == "__main__":
    main()
