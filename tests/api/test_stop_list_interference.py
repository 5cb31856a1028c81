"""A call at every per-request limit at once (the most choices, the worst-case stop list) beside short streams:
what its stop list adds is small next to what its choices' share of the decode batch costs."""

from __future__ import annotations

from mm_serve.bench.interference import beside, median, probe
from tests.api.server_process import ServerProcess

PROBES = 9


def test_a_worst_case_stop_list_costs_other_streams_little_beyond_its_choices(server: ServerProcess) -> None:
    """Short streamed completions are timed alone, beside an ``api.max_n`` call streaming to the end of the
    context without stop strings (the control), and beside the same call with the worst-case legal stop list
    (64 strings, 8,192 characters): the stop list adds under 50 % to the control's TTFT and TPOT (the scan
    it replaced added ~15 ms of front-end time a step: seconds per stream), and neither passes 3x alone.
    (``benchmarks/stop_list_interference.py`` states the figures: TTFT ~1.4-1.6x, TPOT ~2.0x alone, nearly
    all of it the 16 extra sequences in the decode batch on two CPU cores.)"""
    probe(server.url, "tiny")  # warm
    alone = [probe(server.url, "tiny") for _ in range(PROBES)]
    control = beside(server.url, "tiny", PROBES, with_stops=False)
    loaded = beside(server.url, "tiny", PROBES, with_stops=True)
    for which in (0, 1):
        figures = [round(median(t, which) * 1e3, 2) for t in (alone, control, loaded)]
        print(("TTFT", "TPOT")[which], "ms alone, control, loaded:", figures)
        assert median(loaded, which) < 1.5 * median(control, which), figures
        assert median(loaded, which) < 3.0 * median(alone, which), figures
