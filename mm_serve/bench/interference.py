"""How much one call at the per-request limits slows the others: short streamed completions (probes) timed
alone and while such a call streams beside them (``benchmarks/stop_list_interference.py`` and its test)."""

from __future__ import annotations

import json
import multiprocessing
import statistics
import time
from multiprocessing.queues import Queue
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event

import httpx

from mm_serve.config import APIConfig

Timing = tuple[float, float]  # (TTFT, TPOT) of one probe, in seconds


def probe(url: str, model: str) -> Timing:
    """(TTFT, TPOT) in seconds of one short streamed completion (32 tokens, greedy) of ``model`` at ``url``; TPOT
    as vLLM's ``benchmark_serving`` takes it: (last chunk - first chunk) / (completion tokens - 1), the tokens
    from the stream's usage (a chunk may carry several tokens, or none while the detokenizer waits)."""
    body = {"model": model, "prompt": "a purple circle and", "max_tokens": 32, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps, tokens = [], 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if not stamps or tokens < 2:
        raise RuntimeError(f"the probe streamed {len(stamps)} chunks of {tokens} tokens")
    return stamps[0] - start, (stamps[-1] - stamps[0]) / (tokens - 1)


def heavy_body(model: str, n: int | None = None, with_stops: bool = True, api: APIConfig | None = None) -> dict:
    """A call at the limits of ``api`` (the defaults when None), sampled to the end of the context: the worst-case
    legal stop list (``api.max_stop_strings`` strings of ``api.max_stop_chars`` characters together, never
    generated; or none: a control) and ``api.max_logprobs`` log-probabilities per token, with ``n`` choices
    (None: ``api.max_n``)."""
    api = api or APIConfig()
    each = api.max_stop_chars // api.max_stop_strings
    stops = [f"{i:04d}" + "Q" * (each - 4) for i in range(api.max_stop_strings)]
    return {"model": model, "prompt": "a purple circle and", "n": api.max_n if n is None else n, "temperature": 1.0,
            "stream": True, "ignore_eos": True, "logprobs": api.max_logprobs,  # max_tokens: the rest of the context
            **({"stop": stops} if with_stops else {})}


def _stream_heavy(url: str, body: dict, done: Event, chunks: Synchronized, refused: Queue) -> None:
    """Send ``body`` calls one after another until ``done``, counting the chunks of bytes streamed in ``chunks``; a
    refusal is put on ``refused`` and ends the loop. Runs in its own process (:func:`beside`)."""
    while not done.is_set():
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                r.read()
                refused.put(f"HTTP {r.status_code} {r.text[:300]}")
                return
            for _ in r.iter_raw():  # not parsed: its load is the server's, not this client's
                with chunks.get_lock():
                    chunks.value += 1
                if done.is_set():
                    return


def beside(url: str, model: str, probes: int, body: dict) -> list[Timing]:
    """``probes`` probes while ``body`` calls (:func:`heavy_body`) stream one after another from another process
    (another user: reading its streams in this process would hold the GIL from the probes and time the client).

    Raises:
        RuntimeError: the heavy calls were refused or did not stream during the probes.
    """
    context = multiprocessing.get_context("spawn")
    done, chunks, refused = context.Event(), context.Value("q", 0), context.Queue()
    heavy = context.Process(target=_stream_heavy, args=(url, body, done, chunks, refused), daemon=True)
    heavy.start()
    try:
        deadline = time.monotonic() + 60
        while chunks.value < 50 and heavy.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # its choices are decoding
        before = chunks.value
        out = [probe(url, model) for _ in range(probes)]
        streamed = chunks.value - before
    finally:
        done.set()
        heavy.join(60)
        if heavy.is_alive():
            heavy.kill()
            heavy.join()
    problem = refused.get() if not refused.empty() else None
    refused.close()
    if problem or streamed < 10:
        raise RuntimeError(f"the heavy call was not streaming beside the probes: {problem or streamed}")
    return out


def median(timings: list[Timing], which: int) -> float:
    """The median TTFT (``which`` 0) or TPOT (1) of ``timings``, in seconds."""
    return statistics.median(t[which] for t in timings)
