"""The server's own cache counters, read from its Prometheus ``/metrics`` before and after a run.

Counters read (each summed over its label sets; mm-serve exports them):

* ``mm_serve_prefix_cache_queried_tokens_total``: prompt tokens looked up in the prefix cache;
* ``mm_serve_prefix_cache_hit_tokens_total``: of those, tokens whose KV was reused;
* ``mm_serve_encoder_cache_hits_total`` / ``mm_serve_encoder_cache_misses_total``: images
  whose vision-tower features were / were not cached.

A server without ``/metrics`` (or without these counters) gives an empty dict, and the
report shows only what the responses say: any OpenAI server stays measurable.
"""

from __future__ import annotations

import math
import time

import httpx

PREFIX_QUERIED = "mm_serve_prefix_cache_queried_tokens_total"
PREFIX_HITS = "mm_serve_prefix_cache_hit_tokens_total"
ENCODER_HITS = "mm_serve_encoder_cache_hits_total"
ENCODER_MISSES = "mm_serve_encoder_cache_misses_total"
COUNTERS = (PREFIX_QUERIED, PREFIX_HITS, ENCODER_HITS, ENCODER_MISSES)


def parse_counters(text: str, names: tuple[str, ...] = COUNTERS) -> dict[str, float]:
    """The ``names`` found in Prometheus text exposition ``text``, each summed over its label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if "{" in line:  # name{labels} value [timestamp]
            name, rest = line[:line.index("{")], line[line.rindex("}") + 1:]
        else:  # name value [timestamp]
            name, _, rest = line.partition(" ")
        if name.strip() not in names:
            continue
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            out[name.strip()] = out.get(name.strip(), 0.0) + value
    return out


def scrape(base_url: str, api_key: str | None = None, timeout_s: float = 5.0) -> dict[str, float]:
    """The cache counters of the server at ``base_url``; empty if it has no ``/metrics`` or none of them."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(trust_env=False, timeout=timeout_s) as http:
            resp = http.get(base_url.rstrip("/") + "/metrics", headers=headers)
    except httpx.HTTPError:
        return {}
    return parse_counters(resp.text) if resp.status_code == 200 else {}


SETTLE_S = 1.0  # mm-serve workers report their counters every 0.5 s: wait that long, twice, after a run


def scrape_after(base_url: str, api_key: str | None, before: dict[str, float]) -> dict[str, float]:
    """:func:`scrape` once a run is over: when the server has the counters (``before`` is not
    empty), first wait :data:`SETTLE_S` so the workers' last reports reach ``/metrics`` and
    the run's last requests are counted in it, not in the next run."""
    if before:
        time.sleep(SETTLE_S)
    return scrape(base_url, api_key)


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """``after - before`` for the counters present in both (a restarted server's reset shows as absent)."""
    return {k: after[k] - before[k] for k in after if k in before and after[k] >= before[k]}


def prefix_hit_rate(delta: dict[str, float]) -> float:
    """Server-side prefix-cache hit rate over a run (hit / queried tokens); NaN if unknown."""
    queried = delta.get(PREFIX_QUERIED, 0.0)
    return delta[PREFIX_HITS] / queried if queried > 0 and PREFIX_HITS in delta else math.nan


def encoder_hit_rate(delta: dict[str, float]) -> float:
    """Encoder-cache hit rate over a run (hits / (hits + misses) images); NaN if unknown."""
    if ENCODER_HITS not in delta or ENCODER_MISSES not in delta:
        return math.nan
    total = delta[ENCODER_HITS] + delta[ENCODER_MISSES]
    return delta[ENCODER_HITS] / total if total > 0 else math.nan
