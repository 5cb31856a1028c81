"""Tiers and service_tier mapping, the work limit, the queue caps, the image byte budget."""

from __future__ import annotations

import asyncio

import pytest

from mm_serve.admission.bounds import call_work, check_queues, check_work
from mm_serve.admission.byte_budget import ByteBudget
from mm_serve.admission.rejection import Rejection
from mm_serve.config import AdmissionConfig, ConfigError, SLOConfig, load_config
from mm_serve.ground.tiers import Tier
from mm_serve.protocol.service_tier import ALLOWED_VALUES, tier_of


@pytest.mark.parametrize(("value", "tier"), [
    (None, "standard"), ("auto", "standard"), ("default", "standard"), ("priority", "interactive"),
    ("flex", "batch"), ("interactive", "interactive"), ("standard", "standard"), ("batch", "batch"),
])
def test_service_tier_values_map_onto_our_tiers(value: str | None, tier: str) -> None:
    assert tier_of(value, SLOConfig().default).label == tier


def test_auto_follows_the_default_tier_key() -> None:
    slo = load_config(None, {"slo.default_tier": "batch"}).slo
    chosen = tier_of("auto", slo.default)
    assert (chosen.label, int(chosen), slo.of(chosen).ttft_s) == ("batch", 2, 60.0)
    assert slo.ageing_s(chosen) == 59.0 and slo.ageing_s(tier_of("priority", slo.default)) == 0.0


def test_a_looser_request_ages_when_its_slack_is_the_tightest_tiers_ttft_slo() -> None:
    """Ageing (served as interactive from then on): own TTFT SLO less the interactive one, so that
    it still has an interactive request's budget left; at least half its own SLO."""
    defaults = SLOConfig()  # interactive 1 s, standard 4 s, batch 60 s
    assert [defaults.ageing_s(t) for t in Tier] == [0.0, 3.0, 59.0]
    bench = load_config(None, {"slo.tiers.standard.ttft_ms": 2000, "slo.tiers.standard.tpot_ms": 100}).slo
    assert bench.ageing_s(tier_of("default", bench.default)) == 1.0
    close = load_config(None, {"slo.tiers.standard.ttft_ms": 1200, "slo.tiers.standard.tpot_ms": 250}).slo  # 0.2 < 0.6
    assert close.ageing_s(Tier.STANDARD) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="unknown tier 'gold'"):
        Tier.from_label("gold")


def test_an_unknown_service_tier_names_the_allowed_values() -> None:
    with pytest.raises(ValueError, match="'scale' is not supported; allowed: auto, priority, default, flex, "
                                         "interactive, standard, batch"):
        tier_of("scale", SLOConfig().default)
    assert ALLOWED_VALUES == ("auto", "priority", "default", "flex", "interactive", "standard", "batch")
    with pytest.raises(ValueError, match="unknown tier 'gold'"):
        Tier.from_label("gold")


def test_tiers_must_be_ordered_tight_to_loose() -> None:
    with pytest.raises(ConfigError, match="interactive must be at least as tight as slo.tiers.standard"):
        load_config(None, {"slo.tiers.interactive": {"ttft_ms": 9000, "tpot_ms": 100}})
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(None, {"admission.max_queue": 3})


def test_work_is_prompts_times_n_times_prompt_plus_max_tokens() -> None:
    assert call_work([10, 20], [5, 5], n=3) == 3 * 15 + 3 * 25
    cfg = AdmissionConfig(max_request_work_tokens=120)
    check_work([10, 20], [5, 5], 3, cfg)  # 120 tokens: at the limit
    with pytest.raises(Rejection) as info:
        check_work([10, 20], [5, 5], 4, cfg)
    r = info.value
    assert (r.status, r.reason, r.retry_after_s, r.param) == (400, "work_limit", None, "max_tokens")
    assert "asks for 160 tokens of work" in r.message and "n=4" in r.message
    assert "admission.max_request_work_tokens" in r.message


def test_queue_caps_refuse_with_429_and_retry_after() -> None:
    cfg = AdmissionConfig(max_queued_requests=4, max_queued_prompt_tokens=100)
    check_queues(3, 90, 1, 10, cfg)  # exactly at both caps
    with pytest.raises(Rejection) as info:
        check_queues(4, 0, 1, 1, cfg)
    assert (info.value.status, info.value.reason, info.value.retry_after_s) == (429, "queued_requests", 1)
    with pytest.raises(Rejection) as info:
        check_queues(0, 95, 1, 10, cfg)
    assert info.value.reason == "queued_tokens" and "admission.max_queued_prompt_tokens" in info.value.message


def test_byte_budget_queues_what_does_not_fit_then_refuses_it_with_429() -> None:
    """A hold that does not fit waits for room, first come first served: served when another releases within
    ``wait_s``, refused with 429 ``image_bytes`` (Retry-After 1) when none does; a cancelled waiter holds
    nothing; everything goes back on exit, an exception included."""

    async def scenario() -> None:
        budget = ByteBudget(1000)
        async with budget.hold(600, "1 image(s)", 0.0):
            assert budget.reserved == 600
            with pytest.raises(Rejection) as info:
                async with budget.hold(500, "2 image(s)", 0.2):
                    pass
            assert (info.value.status, info.value.reason, info.value.retry_after_s) == (429, "image_bytes", 1)
            assert "2 image(s) need 500 bytes and 600 of 1000" in info.value.message
            assert budget.reserved == 600 and budget.waiting == 0
        order: list[str] = []

        async def call(name: str, nbytes: int, hold_s: float) -> None:
            async with budget.hold(nbytes, name, 5.0):
                order.append(name)
                await asyncio.sleep(hold_s)

        first = asyncio.create_task(call("a", 700, 0.2))
        await asyncio.sleep(0.01)
        queued = [asyncio.create_task(call(name, 600, 0.05)) for name in ("b", "c")]
        small = asyncio.create_task(call("d", 100, 0.0))  # fits now, but waits behind b and c (no jumping the queue)
        await asyncio.sleep(0.01)
        assert budget.waiting == 3 and order == ["a"]
        cancelled = asyncio.create_task(call("e", 900, 0.0))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        await asyncio.gather(first, *queued, small, cancelled, return_exceptions=True)
        assert order == ["a", "b", "c", "d"] and budget.reserved == 0 and budget.waiting == 0
        with pytest.raises(RuntimeError):
            async with budget.hold(1000, "x", 0.0):
                raise RuntimeError("decode failed")
        assert budget.reserved == 0

    asyncio.run(scenario())
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        ByteBudget(0)


def test_a_call_needing_more_than_the_whole_budget_runs_alone() -> None:
    """Images that need more than ``capacity`` hold all of it: refused while anything else is held past
    the wait (429, retry), served when the budget is empty, never refused for good."""

    async def scenario() -> None:
        budget = ByteBudget(1000)
        async with budget.hold(10, "1 image(s)", 0.0):
            with pytest.raises(Rejection):
                async with budget.hold(4000, "3 image(s)", 0.05):
                    pass
        async with budget.hold(4000, "3 image(s)", 0.0):
            assert budget.reserved == 1000
            with pytest.raises(Rejection):
                async with budget.hold(1, "1 image(s)", 0.05):
                    pass
        assert budget.reserved == 0

    asyncio.run(scenario())


def test_an_unknown_service_tier_is_quoted_short_in_its_error() -> None:
    with pytest.raises(ValueError) as info:
        tier_of("x" * 100_000, SLOConfig())
    message = str(info.value)
    assert len(message) < 300 and "... (100000 characters)" in message and "allowed: auto, priority" in message
