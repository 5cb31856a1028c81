"""Attainment feedback: a tier's admission limit tightens while its admitted requests miss their
SLO more often than its attainment target allows, and relaxes when they stop."""

from __future__ import annotations

import math
import random

import pytest

from mm_serve.admission.attainment_feedback import FEEDBACK_STEP, AttainmentFeedback
from mm_serve.admission.controller import AdmissionController
from mm_serve.admission.rejection import Rejection
from mm_serve.config import load_config
from mm_serve.engine.load_ledger import LoadLedger
from mm_serve.engine.load_view import LoadView, Route
from mm_serve.engine.request_state import RequestState
from mm_serve.ground.tiers import Tier


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_factor_stays_at_one_while_requests_are_in_time_and_falls_a_step_per_late_one() -> None:
    feedback = AttainmentFeedback(0.9, clock=_Clock())
    for _ in range(100):
        feedback.observe(late=False)
    assert feedback.value == 1.0 and feedback.aim == pytest.approx(0.95)
    for k in range(1, 6):
        feedback.observe(late=True)
        assert feedback.value == pytest.approx(math.exp(-FEEDBACK_STEP * k))
    for _ in range(200):
        feedback.observe(late=True)
    assert feedback.value == pytest.approx(0.5)  # the floor
    assert (feedback.late, feedback.in_time) == (205, 100)


@pytest.mark.parametrize(("late_share", "tightens"), [(0.2, True), (0.1, True), (0.02, False)])
def test_the_factor_settles_where_the_late_share_meets_the_aim(late_share: float, tightens: bool) -> None:
    """Target 90 %, aim 95 %: a stream 20 % or 10 % late drives the factor to its floor
    (nothing it admits brings the share down here: open loop); 2 % late leaves it near 1."""
    feedback = AttainmentFeedback(0.9, clock=_Clock())
    rng = random.Random(7)
    for _ in range(2000):
        feedback.observe(late=rng.random() < late_share)
    assert (feedback.value < 0.6) if tightens else (feedback.value > 0.85)


def test_without_outcomes_the_factor_decays_back_toward_one() -> None:
    clock = _Clock()
    feedback = AttainmentFeedback(0.9, clock=clock)
    for _ in range(10):
        feedback.observe(late=True)
    low = feedback.value
    clock.now += feedback.half_life_s
    assert math.log(feedback.value) == pytest.approx(math.log(low) / 2)
    clock.now += 8 * feedback.half_life_s  # within 0.5 % of 1: 1 exactly, no "tightened x1.00" in a message
    assert feedback.value == 1.0


def test_a_target_of_one_only_tightens_and_decays_and_bad_arguments_are_refused() -> None:
    feedback = AttainmentFeedback(1.0, clock=_Clock())
    feedback.observe(late=True)
    low = feedback.value
    feedback.observe(late=False)
    assert feedback.value == low < 1
    for bad in ({"target": 0.0}, {"target": 1.5}, {"target": 0.9, "step": 0.0}, {"target": 0.9, "floor": 0.0},
                {"target": 0.9, "half_life_s": 0.0}):
        with pytest.raises(ValueError):
            AttainmentFeedback(**bad)  # type: ignore[arg-type]


class _Client:
    """The one method of EngineClient the controller uses, over a real LoadLedger."""

    def __init__(self, router: LoadLedger) -> None:
        self.router = router

    def load_view(self, tier: Tier, num_tokens: int, max_tokens: int) -> LoadView:
        return self.router.view(tier, Route(0, 0))


def _served(tier: str, ttft_s: float, tpot_s: float) -> RequestState:
    state = RequestState("r", 10, None)  # type: ignore[arg-type]
    state.tier = Tier.from_label(tier)
    state.arrival_time = 100.0
    state.first_token_time = 100.0 + ttft_s
    state.token_times = [state.first_token_time, state.first_token_time + tpot_s]
    state.finish_reason = "stop"
    return state


def _controller_at(fraction: float, **overrides: object) -> tuple[AdmissionController, _Client, float]:
    """A controller whose interactive TTFT SLO puts the prediction of a 100-token request behind
    20000 queued interactive tokens at ``fraction`` of it (admission.margin -0.2: limit 80 %)."""
    router = LoadLedger(1, 1, 1000)
    router.dispatched("q", 0, 0, 20_000, 1, tier=Tier(0))
    client = _Client(router)
    probe = AdmissionController(load_config(None))
    predicted = probe.predict(client, Tier.INTERACTIVE, 100, 0, 16)  # type: ignore[arg-type]
    assert predicted is not None
    slo_ms = predicted.ttft_s / fraction * 1000
    cfg = load_config(None, {"slo.tiers.interactive": {"ttft_ms": slo_ms, "tpot_ms": 200}, **overrides})
    return AdmissionController(cfg), client, slo_ms / 1000


def test_late_interactive_requests_tighten_its_ttft_limit_until_a_call_under_the_margin_is_refused() -> None:
    controller, client, slo = _controller_at(0.7)
    tier = Tier.INTERACTIVE
    assert controller.admit(client, tier, 100, 0, 16) is not None  # type: ignore[arg-type]  # 70 % < 80 %
    for _ in range(5):  # late on TTFT, in time on TPOT
        controller.on_finished(_served("interactive", 2 * slo, 0.001))
    factor = math.exp(-5 * FEEDBACK_STEP)  # 0.67
    assert controller.limit_factor(0, "ttft") == pytest.approx(factor, rel=1e-3)
    assert controller.limit_factor(0, "tpot") == 1.0 and controller.limit_factor(1, "ttft") == 1.0
    with pytest.raises(Rejection) as info:
        controller.admit(client, tier, 100, 0, 16)  # type: ignore[arg-type]  # limit 80 % x 0.67 = 54 % of the SLO
    assert info.value.reason == "ttft_slo" and f"tightened x{factor:.2f}" in info.value.message, info.value.message
    assert "30 % under its TTFT SLO" in info.value.message
    report = controller.feedback_report()
    assert report["interactive"]["ttft"] == {"factor": pytest.approx(factor, abs=1e-3), "late": 5, "in_time": 0}
    assert set(report) == {"interactive", "standard"}  # the batch tier is never refused for latency
    # standard sees the same queue (interactive work ahead) and its own factor is untouched
    assert controller.admit(client, Tier.STANDARD, 100, 0, 16) is not None  # type: ignore[arg-type]


def test_with_attainment_feedback_off_the_margin_alone_decides() -> None:
    controller, client, slo = _controller_at(0.7, **{"admission.attainment_feedback": False})
    for _ in range(30):
        controller.on_finished(_served("interactive", 2 * slo, 0.001))
    assert controller.limit_factor(0, "ttft") == 1.0
    assert controller.feedback_report()["interactive"]["ttft"] == {"factor": 1.0, "late": 30, "in_time": 0}
    assert controller.admit(client, Tier.INTERACTIVE, 100, 0, 16) is not None  # type: ignore[arg-type]
    unpredicted = AdmissionController(load_config(None, {"admission.predict": False}))
    unpredicted.on_finished(_served("interactive", 5.0, 0.001))
    assert unpredicted.limit_factor(0, "ttft") == 1.0
    assert unpredicted.feedback_report()["interactive"]["ttft"]["factor"] == 1.0  # type: ignore[index]


def test_late_tpot_tightens_the_decode_room_kept_for_the_tier() -> None:
    """A standard request may join a decode worker serving interactive ones while the step stays
    within interactive's TPOT limit; interactive requests late on TPOT tighten that limit."""
    cfg = load_config(None, {"slo.tiers.interactive": {"ttft_ms": 10_000, "tpot_ms": 40},
                             "slo.tiers.standard": {"ttft_ms": 10_000, "tpot_ms": 1000}, "admission.margin": 0.0})
    controller = AdmissionController(cfg)
    for _ in range(50):  # 30 ms decode steps: 75 % of interactive's 40 ms
        controller.predictor.observe_decode(4, 1000, 0.03)
    router = LoadLedger(1, 1, 1000)
    router.dispatched("i", 0, 0, 100, 1, tier=Tier(0))
    router.prefilled("i")  # decoding now
    client = _Client(router)
    standard = Tier.STANDARD
    assert controller.admit(client, standard, 100, 0, 16) is not None  # type: ignore[arg-type]
    for _ in range(10):
        controller.on_finished(_served("interactive", 0.1, 0.08))  # late on TPOT only
    assert controller.limit_factor(0, "ttft") == 1.0 and controller.limit_factor(0, "tpot") < 0.7
    with pytest.raises(Rejection) as info:
        controller.admit(client, standard, 100, 0, 16)  # type: ignore[arg-type]
    assert info.value.reason == "tpot_slo" and "serving interactive requests" in info.value.message
    assert "tightened" in info.value.message


def test_late_means_over_the_slo_less_the_margins_headroom() -> None:
    """admission.margin -0.2: a request served in 85 % of its TTFT SLO counts as late (the client
    sees more than the server measures); with a positive margin (tolerance) the SLO itself."""
    controller = AdmissionController(load_config(None))  # interactive TTFT 1 s, TPOT 100 ms
    controller.on_finished(_served("interactive", 0.85, 0.05))
    controller.on_finished(_served("interactive", 0.75, 0.09))
    report = controller.feedback_report()["interactive"]
    assert report["ttft"]["late"] == 1 and report["tpot"]["late"] == 1  # type: ignore[index]
    tolerant = AdmissionController(load_config(None, {"admission.margin": 0.5}))
    tolerant.on_finished(_served("interactive", 0.95, 0.09))
    assert tolerant.feedback_report()["interactive"]["ttft"]["late"] == 0  # type: ignore[index]


def test_a_cancelled_or_batch_request_teaches_nothing() -> None:
    controller = AdmissionController(load_config(None))
    cancelled = _served("interactive", 100.0, 1.0)
    cancelled.finish_reason = None
    controller.on_finished(cancelled)
    controller.on_finished(_served("batch", 1000.0, 10.0))
    assert controller.feedback_report()["interactive"]["ttft"]["late"] == 0  # type: ignore[index]
    assert controller.feedback.factors[(Tier(2), "ttft")].late == 0
