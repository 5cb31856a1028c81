"""Benchmark metrics on known inputs: percentiles, per-request latencies, attainment, early-stop rule."""

from __future__ import annotations

import math

import pytest

from mm_serve.bench.client import allowed_misses
from mm_serve.bench.metrics import Distribution, attainment, meets_slo, percentile, summarize
from mm_serve.bench.records import RequestRecord
from mm_serve.ground.slo import SLO


def record(sent: float, chunks: list[float], end: float, tokens: int, error: str | None = None,
           max_tokens: int = 10) -> RequestRecord:
    return RequestRecord(0, max_tokens, sent_s=sent, chunk_s=chunks, end_s=end, output_tokens=tokens, error=error)


def test_percentiles_interpolate_linearly() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 99.9) == pytest.approx(3.997)
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99.9) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="percentile"):
        percentile(values, 101)


def test_distribution_of_one_to_hundred() -> None:
    d = Distribution.of([float(i) for i in range(1, 101)])
    assert (d.mean, d.p50, d.count) == (50.5, 50.5, 100)
    assert d.p90 == pytest.approx(90.1)
    assert d.p99 == pytest.approx(99.01)
    assert d.p999 == pytest.approx(99.901)


def test_request_latencies() -> None:
    r = record(sent=1.0, chunks=[1.5, 1.6, 1.8, 2.1], end=2.2, tokens=5)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.e2e_s == pytest.approx(1.2)
    assert r.tpot_s == pytest.approx(0.7 / 4)  # (e2e - TTFT) / (tokens - 1)
    assert r.itls_s == pytest.approx([0.1, 0.2, 0.3])
    assert record(0.0, [0.3], 0.3, tokens=1).tpot_s == 0.0


def test_attainment_counts_failures_as_misses() -> None:
    slo = SLO(ttft_s=0.5, tpot_s=0.1)
    good = record(0.0, [0.4, 0.5], 0.6, tokens=3)  # TTFT 0.4, TPOT 0.1
    slow_first = record(0.0, [0.6, 0.7], 0.8, tokens=3)  # TTFT 0.6
    slow_decode = record(0.0, [0.1, 0.5], 0.9, tokens=3)  # TPOT 0.4
    failed = record(0.0, [0.1], 0.2, tokens=1, error="HTTP 503")
    unsent = RequestRecord(4, 3, error="not sent")
    assert [meets_slo(r, slo) for r in (good, slow_first, slow_decode, failed, unsent)] == [
        True, False, False, False, False]
    assert attainment([good, slow_first, slow_decode, failed, unsent], slo) == pytest.approx(0.2)
    assert attainment([], slo) == 0.0


def test_summarize_throughput_and_tokens() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=1.0)
    a = record(0.0, [0.5, 1.0], 1.0, tokens=2)
    b = record(1.0, [1.5, 2.0, 3.0], 3.0, tokens=4)
    b.prompt_tokens = 30
    s = summarize([a, b, RequestRecord(2, 4, error="not sent")], rate=2.0, slo=slo)
    assert (s.num_requests, s.num_ok, s.rate) == (3, 2, 2.0)
    assert s.attainment == pytest.approx(2 / 3)
    assert s.duration_s == pytest.approx(3.0)
    assert s.request_throughput == pytest.approx(2 / 3)
    assert s.output_throughput == pytest.approx(2.0)
    assert s.mean_output_tokens == 3.0 and s.mean_prompt_tokens == 30.0
    assert s.ttft.p50 == pytest.approx(0.5) and s.itl.count == 3
    assert math.isnan(summarize([a], 1.0, None).attainment)


def test_certain_misses_while_running() -> None:
    slo = SLO(ttft_s=0.5, tpot_s=0.1)
    waiting = RequestRecord(0, 11, sent_s=0.0)
    assert not waiting.certainly_misses(0.4, slo)
    assert waiting.certainly_misses(0.6, slo)
    decoding = RequestRecord(1, 11, sent_s=0.0, chunk_s=[0.2])
    assert not decoding.certainly_misses(1.2, slo)  # 1.0 s over at most 10 more tokens: 0.1 s each
    assert decoding.certainly_misses(1.3, slo)
    assert not RequestRecord(2, 5).certainly_misses(100.0, slo)  # not sent yet


def test_allowed_misses() -> None:
    assert allowed_misses(100, 0.9) == 10
    assert allowed_misses(10, 0.9) == 1
    assert allowed_misses(9, 0.9) == 0
    assert allowed_misses(10, 1.0) == 0
