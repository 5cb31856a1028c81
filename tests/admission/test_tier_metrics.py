"""Per-tier SLO metrics: what counts as a finished request and as one that met its SLOs."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from mm_serve.config import load_config
from mm_serve.engine.request_state import RequestState
from mm_serve.ground.tiers import Tier
from mm_serve.metrics.tier_metrics import TierMetrics


def _state(reason: str, ttft_s: float, tpot_s: float, tokens: int = 5) -> RequestState:
    state = RequestState("r", 4, detokenizer=None)  # type: ignore[arg-type]
    state.tier = Tier.INTERACTIVE
    state.arrival_time = 100.0
    state.first_token_time = 100.0 + ttft_s
    state.token_times = [state.first_token_time + i * tpot_s for i in range(tokens)]
    state.finish_reason = reason
    return state


def _value(registry: CollectorRegistry, name: str) -> float:
    got = registry.get_sample_value(name, {"tier": "interactive"})
    return 0.0 if got is None else got


def test_only_requests_that_ran_to_a_stop_or_the_length_limit_count() -> None:
    cfg = load_config(None, {"slo.tiers.interactive": {"ttft_ms": 500, "tpot_ms": 50}})
    registry = CollectorRegistry()
    metrics = TierMetrics(registry, cfg.slo)
    metrics.observe_finished(_state("stop", 0.1, 0.01))    # met
    metrics.observe_finished(_state("length", 0.9, 0.01))  # missed: TTFT
    metrics.observe_finished(_state("abort", 0.1, 0.01))   # the client left: neither
    metrics.observe_finished(_state("error", 0.1, 0.01))   # failed: neither
    assert _value(registry, "mm_serve_tier_finished_total") == 2
    assert _value(registry, "mm_serve_tier_slo_met_total") == 1
    assert _value(registry, "mm_serve_tier_attainment") == 0.5
