"""Text tables and the JSON file of a benchmark: per-run latencies, goodput per system, the ratio.

Times are printed in seconds (TTFT, e2e) or milliseconds (TPOT, ITL); rates in
requests/s; throughput in requests/s and output tokens/s; hit rates in percent. For
conversational workloads the TTFT percentiles are also given per turn, and whenever
the server reports them, the prompt-cache hit rate (``cached_tokens``) and its
``/metrics`` cache counters. In the JSON every time is
in seconds and a missing value (no finished request) is ``null``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mm_serve.bench.cache_stats import FOLLOW_UPS
from mm_serve.bench.metrics import Distribution, RunSummary
from mm_serve.bench.repeats import RepeatedGoodput, format_repeated, group_goodputs, median_ratio
from mm_serve.bench.server_metrics import (
    ENCODER_HITS,
    ENCODER_MISSES,
    encoder_hit_rate,
    prefix_hit_rate,
)
from mm_serve.bench.sweep import SweepResult
from mm_serve.ground.slo import SLO


@dataclass(frozen=True)
class SystemResult:
    """Everything measured for one system under test."""

    name: str  # e.g. "disaggregated", "colocated", "vllm"
    url: str
    unloaded: RunSummary  # requests sent one at a time
    sweep: SweepResult | None = None  # with --sweep
    single: RunSummary | None = None  # with --rate
    round: int = 1  # 1-based round of --repeat

    @property
    def runs(self) -> tuple[RunSummary, ...]:
        """Every loaded run, by rate."""
        if self.sweep is not None:
            return self.sweep.runs
        return (self.single,) if self.single is not None else ()


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1e3:.1f}"


def _s(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3f}"


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.1f}"


def format_run(name: str, run: RunSummary) -> str:
    """One progress line for a finished run (with the per-turn TTFT and cache lines, if any)."""
    flag = " (stopped early)" if run.stopped_early else ""
    if run.burst:
        flag += (f" (a burst: all sent in {run.arrival_span_s:.3f} s, under the median e2e {run.e2e.p50:.3f} s; "
                 "it does not measure this rate: send more requests)")
    errors = {k: v for k, v in run.errors.items() if k not in ("cancelled", "not sent")}
    if errors:
        message, count = max(errors.items(), key=lambda kv: kv[1])
        flag += f"; {sum(errors.values())} failed, e.g. {message!r} x{count}"
    line = (f"[{name}] {run.rate:.3f} req/s: {run.num_requests} requests, {run.num_ok} ok, "
            f"attainment {100 * run.attainment:.1f} %{flag}; TTFT p90 {_s(run.ttft.p90)} s, "
            f"TPOT p90 {_ms(run.tpot.p90)} ms, {run.output_throughput:.0f} tok/s")
    return "\n".join([line, *(f"[{name}]   {extra}" for extra in cache_lines(run))])


def turn_line(run: RunSummary) -> str | None:
    """TTFT p50/p90 (s) per turn: turn 1, turns 2+, then each turn; None without turns."""
    if not run.ttft_by_turn:
        return None
    keys = ["1", FOLLOW_UPS, *sorted((k for k in run.ttft_by_turn if k not in ("1", FOLLOW_UPS)), key=int)]
    parts = [f"{'turns' if k == FOLLOW_UPS else 'turn'} {k} {_s(run.ttft_by_turn[k].p50)} / "
             f"{_s(run.ttft_by_turn[k].p90)}" for k in keys if k in run.ttft_by_turn]
    return "TTFT p50 / p90 (s) by turn: " + ", ".join(parts)


def cache_lines(run: RunSummary) -> list[str]:
    """Per-turn TTFT and the cache figures of ``run``, each only when there is something to say."""
    lines = [line] if (line := turn_line(run)) is not None else []
    if run.cache.requests:
        lines.append(f"prompt-cache hit rate {_pct(run.cache.hit_rate)} % (cached_tokens {run.cache.cached_tokens} "
                     f"of {run.cache.prompt_tokens} prompt tokens, {run.cache.requests} responses)")
    counters = run.server_counters
    if counters:
        images = counters.get(ENCODER_HITS, 0.0) + counters.get(ENCODER_MISSES, 0.0)
        lines.append(f"server /metrics: prefix-cache hit rate {_pct(prefix_hit_rate(counters))} % (tokens), "
                     f"encoder-cache hit rate {_pct(encoder_hit_rate(counters))} % of {images:.0f} images")
    return lines


def _latency_line(label: str, d: Distribution, to_ms: bool) -> str:
    fmt = _ms if to_ms else _s
    unit = "ms" if to_ms else "s"
    return (f"  {label:<5} mean {fmt(d.mean)}  p50 {fmt(d.p50)}  p90 {fmt(d.p90)}  "
            f"p99 {fmt(d.p99)}  p99.9 {fmt(d.p999)} {unit}")


def format_unloaded(result: SystemResult) -> str:
    """The unloaded latencies of one system, one metric per line."""
    u = result.unloaded
    return "\n".join([f"{result.name}: unloaded ({u.num_ok} requests, one at a time)",
                      _latency_line("TTFT", u.ttft, False), _latency_line("TPOT", u.tpot, True),
                      _latency_line("ITL", u.itl, True), _latency_line("e2e", u.e2e, False),
                      *(f"  {line}" for line in cache_lines(u))])


def format_runs(result: SystemResult) -> str:
    """A table of a system's loaded runs: rate, attainment, latency percentiles, throughput."""
    head = (f"{'rate':>7} {'n':>5} {'attain%':>7} {'TTFT p50':>8} {'p90':>7} {'p99':>7} "
            f"{'TPOT p50':>8} {'p90':>6} {'p99':>6} {'ITL p99':>7} {'e2e p90':>7} {'req/s':>6} {'tok/s':>6}")
    lines = [f"{result.name} ({result.url}): rate in req/s, TTFT and e2e in s, TPOT and ITL in ms", head]
    for r in result.runs:
        mark = "*" if r.stopped_early else "b" if r.burst else " "
        lines.append(
            f"{r.rate:>7.3f} {r.num_requests:>5} {100 * r.attainment:>6.1f}{mark} {_s(r.ttft.p50):>8} "
            f"{_s(r.ttft.p90):>7} {_s(r.ttft.p99):>7} {_ms(r.tpot.p50):>8} {_ms(r.tpot.p90):>6} "
            f"{_ms(r.tpot.p99):>6} {_ms(r.itl.p99):>7} {_s(r.e2e.p90):>7} "
            f"{r.request_throughput:>6.2f} {r.output_throughput:>6.0f}"
        )
    for r in result.runs:
        lines += [f"  at {r.rate:.3f} req/s: {extra}" for extra in cache_lines(r)]
    if any(r.stopped_early for r in result.runs):
        lines.append("  * stopped early once the target was out of reach; unfinished requests count as misses")
    if any(r.burst and not r.stopped_early for r in result.runs):
        lines.append("  b a burst: every request was sent before the median one finished, so the run does not "
                     "measure its rate (the goodput search does not credit it); send more requests")
    sweep = result.sweep
    if sweep is not None and sweep.goodput == 0 and any(r.burst and r.attainment >= sweep.target for r in sweep.runs):
        lines.append("  no rate was measured: every run that met the target was a burst, and the search stopped at "
                     "its lowest rate; send more requests (--num-requests, --duration) or start lower (--start-rate)")
    return "\n".join(lines)


def repeated_goodputs(results: Sequence[SystemResult]) -> list[RepeatedGoodput]:
    """The swept systems' goodputs grouped by system (one per ``--repeat`` round), first-measured first."""
    return group_goodputs([(r.name, r.sweep.goodput) for r in results if r.sweep is not None])


def format_goodput(results: Sequence[SystemResult], slo: SLO, target: float) -> str:
    """The goodput table (median and range when repeated), and the ratio of the first system to each other one."""
    lines = [f"goodput: highest rate with >= {100 * target:.0f} % of requests within "
             f"TTFT {slo.ttft_s:g} s and TPOT {slo.tpot_s * 1e3:g} ms"]
    return "\n".join(lines + format_repeated(repeated_goodputs(results)))


def goodput_ratio(results: Sequence[SystemResult]) -> float | None:
    """First system's (median) goodput over the second's (None unless both were swept; inf over 0)."""
    groups = repeated_goodputs(results)
    return median_ratio(groups[0], groups[1]) if len(groups) >= 2 else None


def _clean(value: Any) -> Any:
    """NaN and infinities → None, recursively, so the file is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path: Path, results: Sequence[SystemResult], slo: SLO, target: float,
               settings: dict[str, Any]) -> None:
    """Write the whole benchmark (settings, SLOs, every run of every system) as JSON."""
    doc = {
        "format": "mm-serve-bench/1",
        "settings": settings,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "attainment_target": target},
        "systems": [asdict(r) | {"goodput": r.sweep.goodput if r.sweep else None} for r in results],
        "goodput_ratio": goodput_ratio(results),
        "repeats": [g.as_dict() for g in repeated_goodputs(results)],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(doc), indent=1) + "\n")
