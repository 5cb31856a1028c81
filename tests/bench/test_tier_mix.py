"""``mm-serve bench --tier-mix``: parsing, per-request tiers in the bodies, the per-tier figures."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from mm_serve.bench.records import RequestRecord
from mm_serve.bench.requests import RequestFactory
from mm_serve.bench.tier_report import draw_tier, parse_tier_mix, refused, tier_lines
from mm_serve.config import SLOConfig
from mm_serve.workloads import RequestSpec


def test_parse_tier_mix_normalises_and_refuses_bad_input() -> None:
    assert parse_tier_mix("interactive=3,standard=5,batch=2") == {"interactive": 0.3, "standard": 0.5, "batch": 0.2}
    for bad, match in (("gold=1", "tiers interactive, standard, batch"), ("batch=x", "not a number"),
                       ("batch=-1", ">= 0"), ("batch=0", "add up to 0"), ("batch", "tier=share")):
        with pytest.raises(ValueError, match=match):
            parse_tier_mix(bad)


def test_tiers_are_drawn_per_request_and_sent_as_service_tier() -> None:
    mix = parse_tier_mix("interactive=0.3,standard=0.5,batch=0.2")
    draws = Counter(draw_tier(mix, i) for i in range(2000))
    assert 0.25 < draws["interactive"] / 2000 < 0.35 and 0.15 < draws["batch"] / 2000 < 0.25
    assert [draw_tier(mix, i) for i in range(20)] == [draw_tier(mix, i) for i in range(20)]
    factory = RequestFactory("m", tier_mix=mix)
    plan = factory.plan([RequestSpec(prompt_tokens=8, output_tokens=4)] * 6, [0.0] * 6)
    for planned in plan:
        assert json.loads(planned.body)["service_tier"] == planned.tier == draw_tier(mix, planned.index)
    assert "service_tier" not in json.loads(RequestFactory("m").body(RequestSpec(8, 4), 0))


def _record(tier: str, ttft: float, tpot: float, error: str | None = None) -> RequestRecord:
    rec = RequestRecord(0, 3, sent_s=0.0, tier=tier, error=error, end_s=ttft + 2 * tpot, output_tokens=3)
    rec.chunk_s = [] if error else [ttft, ttft + tpot, ttft + 2 * tpot]
    return rec


def test_tier_lines_report_refusals_attainment_of_admitted_and_goodput() -> None:
    records = [_record("interactive", 0.5, 0.05), _record("interactive", 2.0, 0.05),  # met, missed TTFT
               _record("interactive", 0, 0, "HTTP 429: overloaded"), _record("batch", 30.0, 1.0)]
    lines = tier_lines(records, SLOConfig(), duration_s=10.0)
    assert len(lines) == 2  # no standard requests
    assert "interactive" in lines[0] and "sent    3" in lines[0] and "refused  33.3 %" in lines[0]
    assert "attainment of admitted  50 %" in lines[0] and "goodput of admitted 0.10 req/s" in lines[0]
    assert "batch" in lines[1] and "refused   0.0 %" in lines[1] and "100 %" in lines[1]
    assert refused(records[2]) and not refused(records[0])
