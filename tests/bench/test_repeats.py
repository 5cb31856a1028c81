"""Repeated goodput searches: grouping by system, medians, ranges and ratios (mm_serve.bench.repeats)."""

from __future__ import annotations

import math

from mm_serve.bench.repeats import format_repeated, group_goodputs, median_ratio, round_ratios


def test_alternating_rounds_group_by_system_in_first_seen_order() -> None:
    swept = [("disaggregated", 4.0), ("colocated", 3.0), ("disaggregated", 6.0),
             ("colocated", 2.0), ("disaggregated", 5.0), ("colocated", 4.5)]
    disagg, coloc = group_goodputs(swept)
    assert disagg.name == "disaggregated" and disagg.goodputs == (4.0, 6.0, 5.0)
    assert (disagg.median, disagg.low, disagg.high) == (5.0, 4.0, 6.0)
    assert (coloc.median, coloc.low, coloc.high) == (3.0, 2.0, 4.5)
    assert median_ratio(disagg, coloc) == 5.0 / 3.0
    assert round_ratios(disagg, coloc) == [4.0 / 3.0, 3.0, 5.0 / 4.5]
    lines = format_repeated([disagg, coloc])
    assert "5.000 req/s median [4.000-6.000] over 3 rounds: 4.000, 6.000, 5.000" in lines[0]
    assert lines[2] == "  ratio disaggregated / colocated: 1.67x (of the medians; round by round 1.11-3.00x)"


def test_one_round_prints_as_before_and_zero_goodput_ratio_is_infinite() -> None:
    a, b = group_goodputs([("a", 2.0), ("b", 0.0)])
    assert format_repeated([a, b]) == ["  a                   2.000 req/s", "  b                   0.000 req/s",
                                       "  ratio a / b: infx"]
    assert math.isinf(median_ratio(a, b))
    assert a.as_dict() == {"name": "a", "goodputs": [2.0], "median": 2.0, "low": 2.0, "high": 2.0}
