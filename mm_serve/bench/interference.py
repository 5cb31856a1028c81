"""How much one call at the per-request limits slows the others: short streamed completions (probes) timed
alone and while such a call streams beside them (``benchmarks/stop_list_interference.py`` and its test)."""

from __future__ import annotations

import json
import statistics
import threading
import time

import httpx

from mm_serve.config import APIConfig

Timing = tuple[float, float]  # (TTFT, TPOT) of one probe, in seconds


def probe(url: str, model: str) -> Timing:
    """(TTFT, TPOT) in seconds of one short streamed completion (32 tokens, greedy) of ``model`` at ``url``."""
    body = {"model": model, "prompt": "a purple circle and", "max_tokens": 32, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start = time.perf_counter()
    stamps = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                stamps.append(time.perf_counter())
    return stamps[0] - start, (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)


def heavy_body(model: str, with_stops: bool, api: APIConfig | None = None) -> dict:
    """A call at the limits of ``api`` (the defaults when None): ``api.max_n`` choices sampled to the end of the
    context, with the worst-case legal stop list (``api.max_stop_strings`` strings of ``api.max_stop_chars``
    characters together, never generated) or none (the control)."""
    api = api or APIConfig()
    each = api.max_stop_chars // api.max_stop_strings
    stops = [f"{i:04d}" + "Q" * (each - 4) for i in range(api.max_stop_strings)]
    return {"model": model, "prompt": "a purple circle and", "n": api.max_n, "temperature": 1.0,  # max_tokens: the context
            "stream": True, "ignore_eos": True, **({"stop": stops} if with_stops else {})}


def beside(url: str, model: str, probes: int, with_stops: bool) -> list[Timing]:
    """``probes`` probes while :func:`heavy_body` calls stream one after another.

    Raises:
        RuntimeError: the heavy calls were refused or did not stream during the probes.
    """
    done = threading.Event()
    lines: list[int] = []
    refused: list[str] = []

    def heavy() -> None:
        while not done.is_set():
            with httpx.stream("POST", f"{url}/v1/completions", json=heavy_body(model, with_stops), timeout=600) as r:
                if r.status_code != 200:
                    r.read()
                    refused.append(f"HTTP {r.status_code} {r.text[:300]}")
                    return
                for _ in r.iter_lines():
                    lines.append(1)
                    if done.is_set():
                        return

    thread = threading.Thread(target=heavy, daemon=True)
    thread.start()
    time.sleep(2.0)  # its choices are decoding
    before = len(lines)
    out = [probe(url, model) for _ in range(probes)]
    streamed = len(lines) - before
    done.set()
    thread.join(60)
    if refused or streamed < 10:
        raise RuntimeError(f"the heavy call was not streaming beside the probes: {refused or streamed}")
    return out


def median(timings: list[Timing], which: int) -> float:
    """The median TTFT (``which`` 0) or TPOT (1) of ``timings``, in seconds."""
    return statistics.median(t[which] for t in timings)
