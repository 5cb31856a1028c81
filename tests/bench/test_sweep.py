"""Goodput search against a simulated server of known capacity (deterministic, no I/O)."""

from __future__ import annotations

import pytest

from mm_serve.bench.metrics import RunSummary, summarize
from mm_serve.bench.records import RequestRecord
from mm_serve.bench.sweep import find_goodput
from mm_serve.ground.slo import SLO
from mm_serve.workloads import unit_rate_arrivals

SERVICE_S = 0.25  # one request at a time: capacity 4 requests/s
SLO_FIXED = SLO(ttft_s=SERVICE_S + 0.5, tpot_s=0.05)
N = 200


def fifo_server(rate: float, cv: float = 0.01, n: int = N, service_s: float = SERVICE_S) -> list[RequestRecord]:
    """A single FIFO server: TTFT = queueing + ``service_s``; 3 tokens 10 ms apart."""
    free_at, records = 0.0, []
    for i, t in enumerate(x / rate for x in unit_rate_arrivals(n, seed=0, cv=cv)):
        first = max(t, free_at) + service_s
        free_at = first
        records.append(RequestRecord(i, 3, sent_s=t, chunk_s=[first, first + 0.01, first + 0.02],
                                     end_s=first + 0.02, output_tokens=3))
    return records


def probe(rate: float) -> RunSummary:
    return summarize(fifo_server(rate), rate, SLO_FIXED)


def test_goodput_of_deterministic_queue() -> None:
    # Nearly deterministic arrivals: no queueing below 4 req/s; above it request k waits
    # k (0.25 - 1/rate) s, so 90 % of 200 meet the 0.5 s slack only up to ~4.05 req/s.
    for start in (0.1, 1.0, 3.9, 40.0):
        result = find_goodput(probe, target=0.9, start_rate=start, rel_tol=0.05, min_rate=0.01)
        assert 4.05 / 1.05 <= result.goodput <= 4.05, start
        assert len(result.runs) <= 12
        assert [r.rate for r in result.runs] == sorted(r.rate for r in result.runs)
        passing = [r.rate for r in result.runs if r.attainment >= 0.9]
        assert max(passing) == result.goodput


def test_poisson_goodput_is_below_capacity() -> None:
    # Poisson arrivals queue below capacity too, so the goodput is strictly lower.
    def poisson_probe(rate: float) -> RunSummary:
        return summarize(fifo_server(rate, cv=1.0), rate, SLO_FIXED)

    result = find_goodput(poisson_probe, target=0.9, start_rate=2.0, rel_tol=0.05)
    assert 1.0 < result.goodput < 4.0


def test_nothing_passes_gives_zero() -> None:
    strict = SLO(ttft_s=0.1, tpot_s=0.05)  # below the service time
    result = find_goodput(lambda r: summarize(fifo_server(r), r, strict), 0.9, start_rate=8.0)
    assert result.goodput == 0.0
    assert min(r.rate for r in result.runs) >= 8.0 / 64


def test_each_rate_is_probed_once() -> None:
    seen: list[float] = []

    def counting(rate: float) -> RunSummary:
        seen.append(rate)
        return probe(rate)

    find_goodput(counting, 0.9, start_rate=1.0, rel_tol=0.1)
    assert len(seen) == len(set(seen))


@pytest.mark.parametrize("start, tol", [(0.0, 0.1), (float("inf"), 0.1), (1.0, 0.0)])
def test_bad_arguments(start: float, tol: float) -> None:
    with pytest.raises(ValueError):
        find_goodput(probe, 0.9, start_rate=start, rel_tol=tol)


def test_a_burst_is_not_credited_as_a_rate() -> None:
    """A server that answers any number of requests at once in 0.52 s passes every rate with a fixed count of
    requests; once they are all sent before the median one finished (20 requests: above ~37 req/s) a probe
    measures a burst, not a rate, and the search does not credit it."""
    def unbounded(rate: float) -> RunSummary:
        records = [RequestRecord(i, 3, sent_s=t, chunk_s=[t + 0.5, t + 0.51, t + 0.52], end_s=t + 0.52,
                                 output_tokens=3)
                   for i, t in enumerate(x / rate for x in unit_rate_arrivals(20, seed=0, cv=0.01))]
        return summarize(records, rate, SLO_FIXED)

    assert unbounded(1000.0).attainment == 1.0 and unbounded(1000.0).burst
    assert not unbounded(10.0).burst
    result = find_goodput(unbounded, 0.9, start_rate=4.0, rel_tol=0.05)
    arrivals = unit_rate_arrivals(20, seed=0, cv=0.01)
    span = arrivals[-1] - arrivals[0]  # seconds from the first send to the last at 1 request/s
    assert span / 0.52 / 1.05 <= result.goodput <= span / 0.52
    assert all(r.burst for r in result.runs if r.rate > result.goodput)


def test_a_search_of_bursts_only_says_no_rate_was_measured() -> None:
    """Started far above what 20 requests can measure, every passing probe is a burst down to the search's
    floor: the goodput is 0 and the table says why, instead of a bare 0 req/s."""
    from mm_serve.bench.report import SystemResult, format_runs

    def unbounded(rate: float) -> RunSummary:
        records = [RequestRecord(i, 3, sent_s=t, chunk_s=[t + 0.5, t + 0.51, t + 0.52], end_s=t + 0.52,
                                 output_tokens=3)
                   for i, t in enumerate(x / rate for x in unit_rate_arrivals(20, seed=0, cv=0.01))]
        return summarize(records, rate, SLO_FIXED)

    result = find_goodput(unbounded, 0.9, start_rate=100_000.0)
    assert result.goodput == 0 and all(r.burst and r.attainment == 1 for r in result.runs)
    table = format_runs(SystemResult("fake", "http://x", unbounded(1.0), sweep=result))
    assert "no rate was measured: every run that met the target was a burst" in table
