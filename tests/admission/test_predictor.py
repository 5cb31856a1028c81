"""The online fit, the latency predictor and the admission rule (with a router's real load view)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
import time
from pathlib import Path

import pytest

from mm_serve.admission.controller import AdmissionController
from mm_serve.admission.online_fit import OnlineLinearFit
from mm_serve.admission.predictor import (
    DEFAULT_OVERHEAD_S,
    DEFAULT_PREFILL,
    OVERHEAD_WEIGHT,
    TRANSIT_WEIGHT,
    LatencyPredictor,
    Prediction,
    QueueAhead,
)
from mm_serve.admission.ratio_correction import RatioCorrection
from mm_serve.admission.rejection import Rejection
from mm_serve.config import load_config
from mm_serve.engine.load_ledger import LoadLedger
from mm_serve.engine.load_view import LoadView, Route
from mm_serve.engine.request_state import RequestState
from mm_serve.ground.tiers import Tier
from mm_serve.models.named_models import EMBEDDED_MODEL_DIR
from mm_serve.planner.errors import ProfileError
from mm_serve.planner.profile_file import (
    DecodePoint,
    EncodePoint,
    PrefillPoint,
    parse_profile,
    profile_to_json,
)
from mm_serve.runtime import messages


def test_a_wrong_start_corrects_itself_within_a_few_dozen_steps() -> None:
    """Started 5x off, the fit predicts within 2 % after 40 noisy-free points of varied size."""
    fit = OnlineLinearFit([0.02, 1e-4], [1.0, 1000.0])
    rng = random.Random(0)
    for _ in range(40):
        tokens = rng.randint(16, 4000)
        fit.observe([1.0, tokens], 0.003 + 5e-5 * tokens)
    assert fit.predict([1.0, 1000]) == pytest.approx(0.053, rel=0.02)
    assert fit.num_observations == 40 and fit.updated_at is not None


def test_the_fit_stays_bounded_on_thousands_of_collinear_noisy_steps() -> None:
    """Decode steps under load: batch size and context tokens grow together, times are noisy
    with rare stalls. The first fit (recursive least squares) diverged on such a stream
    (coefficients of 1e13 after 20,000 steps, so admission refused everything); this one
    stays non-negative and predicts the mean step within 15 %."""
    fit = OnlineLinearFit([0.004, 2e-4, 2e-7], [1.0, 16.0, 4096.0], forgetting=0.99)
    rng = random.Random(1)
    for _ in range(20_000):
        batch = rng.randint(1, 24)
        context = batch * rng.randint(250, 300)
        stall = 0.05 if rng.random() < 0.01 else 0.0
        fit.observe([1.0, batch, context], (0.004 + 3e-4 * batch + 1e-7 * context) * rng.lognormvariate(0, 0.3) + stall)
    assert all(c >= 0 for c in fit.coefficients)
    true_mean = (0.004 + 3e-4 * 12 + 1e-7 * 12 * 275) * math.exp(0.3**2 / 2) + 0.01 * 0.05
    assert fit.predict([1.0, 12, 12 * 275]) == pytest.approx(true_mean, rel=0.15)
    fit.observe([1.0, 1, float("nan")], 1.0)  # a broken measurement is ignored
    assert fit.num_observations == 20_000


def test_the_fit_keeps_coefficients_non_negative_and_the_prior_where_data_says_nothing() -> None:
    """Every llava prompt has one image and about the same tokens: the data fix their sum, not
    the split; the prior decides the split, and no coefficient goes negative."""
    fit = OnlineLinearFit([0.004, 2e-5, 0.004], [1.0, 1000.0, 1.0])
    for i in range(200):
        fit.observe([1.0, 250 + i % 3, 1], 0.02)
    c, per_token, per_image = fit.coefficients
    assert min(c, per_token, per_image) >= 0
    assert fit.predict([1.0, 251, 1]) == pytest.approx(0.02, rel=0.02)
    fresh = OnlineLinearFit([0.004, 2e-5, 0.004], [1.0, 1000.0, 1.0])
    assert fresh.coefficients == pytest.approx([0.004, 2e-5, 0.004])  # no data: the start


def test_a_slow_batch_with_one_image_does_not_set_the_image_term_for_good() -> None:
    """Measured on a fresh server (default prefill fit): 45 calls at once, 40 with the same image.
    The encoder cache encodes it once, in a batch that ran slow (the front end decoding 40
    images on the shared core); every later batch hits the cache and encodes none. The first
    fit (an absolute ridge) put the whole batch on the image term (0.20 s, 50x its start) and
    kept it there, so a single call with that image, where its prefix was not cached, was
    predicted seconds and refused. With the relative prior the split follows the prior's
    shares, and the image term drifts back toward its start as that batch fades."""
    fit = OnlineLinearFit(DEFAULT_PREFILL, (1.0, 1000.0, 1.0))
    burst = [(14, 0, 0.0765), (56, 0, 0.0426), (631, 1, 0.2306), (120, 0, 0.0211), (118, 0, 0.0169),
             (114, 0, 0.0169), (118, 0, 0.0136)]  # (tokens computed, images encoded, seconds)
    for tokens, images, seconds in burst:
        fit.observe([1.0, tokens, images], seconds)
    assert fit.coefficients[2] < 0.25 * 0.2306  # not the slow batch's whole time
    for _ in range(60):  # the cached repeats: no image encoded
        fit.observe([1.0, 118, 0], 0.015)
    assert fit.coefficients[2] < 4 * DEFAULT_PREFILL[2]
    assert fit.predict([1.0, 118, 0]) == pytest.approx(0.015, rel=0.05)


def test_warm_start_makes_the_profile_fit_the_prior() -> None:
    """After an ``mm-serve profile`` warm start, live steps that never encode an image leave the
    image term at the profile's (not the built-in default's), and the token term is the profile's."""
    data = profile_to_json("cpu", "cpu", 8e9, str(EMBEDDED_MODEL_DIR),
                           [PrefillPoint(t, b, 0.002 + 1e-4 * t * b) for t in (64, 256, 1024) for b in (1, 4)],
                           [DecodePoint(b, c, 0.003 + 1e-4 * b + 1e-8 * b * c) for b in (1, 8) for c in (128, 1024)],
                           [EncodePoint(n, 0.002 + 0.05 * n) for n in (1, 2, 4)])
    predictor = LatencyPredictor(prefill_batch_size=8, prefill_token_budget=4096)
    predictor.warm_start(parse_profile(data, Path("."), "profile"))
    assert predictor.prefill.coefficients[1] == pytest.approx(1e-4, rel=0.1)
    assert predictor.prefill.coefficients[2] == pytest.approx(0.05, rel=0.1)
    for _ in range(200):
        predictor.observe_prefill(500, 0, 0.002 + 1e-4 * 500)
    assert predictor.prefill.coefficients[2] == pytest.approx(0.05, rel=0.1)  # the default is 0.004
    assert predictor.prefill_seconds(500, 1) == pytest.approx(0.102, rel=0.1)


def test_the_fit_refuses_inconsistent_shapes() -> None:
    with pytest.raises(ValueError, match="one entry per feature"):
        OnlineLinearFit([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="forgetting must be in"):
        OnlineLinearFit([1.0], [1.0], forgetting=0.0)
    with pytest.raises(ValueError, match="prior_weight must be"):
        OnlineLinearFit([1.0], [1.0], prior_weight=0.0)


def test_ttft_is_queue_ahead_plus_own_prefill_plus_overhead() -> None:
    predictor = LatencyPredictor(prefill_batch_size=2, prefill_token_budget=1000)
    c, per_token, per_image = predictor.prefill.coefficients
    ahead = QueueAhead(requests=3, tokens=1500, images=1)
    batches = 2  # 3 requests at 2 per batch; 1500 tokens at 1000 per batch
    queue = c + per_token * 1500 + per_image * 1 + (batches - 1) * c
    p = predictor.predict(ahead, tokens=600, images=1, decode_batch=4, decode_context=2000)
    assert p.queue_s == pytest.approx(queue)
    assert p.ttft_s == pytest.approx(queue + c + per_token * 600 + per_image + predictor.overhead_s)
    d0, per_request, per_context = predictor.decode.coefficients
    assert p.tpot_s == pytest.approx(d0 + per_request * 4 + per_context * 2000)
    assert predictor.predict(QueueAhead(0, 0, 0), 600, 1, 1, 600).queue_s == 0.0


def test_finished_requests_correct_a_systematic_underestimate() -> None:
    """The fits price one step; requests that live through longer (a decode batch that grows, a
    wait for a decode slot) teach the corrections, so predictions come out that much longer."""
    predictor = LatencyPredictor(prefill_batch_size=8, prefill_token_budget=4096)
    first = predictor.predict(QueueAhead(2, 500, 2), 250, 1, 10, 3000)
    for _ in range(60):
        p = predictor.predict(QueueAhead(2, 500, 2), 250, 1, 10, 3000)
        predictor.observe_finished(p, prefill_span_s=1.5 * p.ttft_base_s, tpot_s=2.0 * p.tpot_step_s)
    after = predictor.predict(QueueAhead(2, 500, 2), 250, 1, 10, 3000)
    assert after.tpot_step_s == pytest.approx(first.tpot_step_s)  # the fit itself is unchanged
    assert after.tpot_s == pytest.approx(2.0 * first.tpot_s, rel=0.01)
    assert after.ttft_s - predictor.overhead_s == pytest.approx(1.5 * first.ttft_base_s, rel=0.01)
    assert predictor.report()["tpot_correction"] == pytest.approx(2.0, rel=0.01)
    predictor.observe_finished(after, None, -1.0)  # nothing measured: nothing learned
    assert predictor.tpot_correction.num_observations == 60


def test_corrections_learn_against_the_fits_as_they_are_when_a_request_finishes() -> None:
    """Requests admitted on the starting coefficients (a fresh server), whose steps then teach the fits
    that prefill and decode cost 10x and 3x as much: measured as the fits price them now, they teach
    the corrections nothing (learned against the old prices, a correction would scale every later
    prediction by 10)."""
    predictor = LatencyPredictor(prefill_batch_size=8, prefill_token_budget=4096)
    admitted = [predictor.predict(QueueAhead(0, 0, 0), 250, 1, 2, 600) for _ in range(20)]
    prefill_then, step_then = admitted[0].ttft_base_s, admitted[0].tpot_step_s
    for _ in range(200):
        predictor.observe_prefill(250, 1, 10 * prefill_then)
        predictor.observe_decode(2, 600, 3 * step_then)
    assert predictor.prefill_seconds(250, 1) == pytest.approx(10 * prefill_then, rel=0.01)
    assert predictor.decode.predict((1.0, 2, 600)) == pytest.approx(3 * step_then, rel=0.01)
    for p in admitted:
        base, step = predictor.repriced(p)
        assert base == pytest.approx(predictor.prefill_seconds(250, 1))
        assert step == pytest.approx(predictor.decode.predict((1.0, 2, 600)))
        predictor.observe_finished(p, prefill_span_s=base, tpot_s=step)
    assert predictor.ttft_corrections[Tier.STANDARD].value == pytest.approx(1.0)
    assert predictor.tpot_correction.value == pytest.approx(1.0)
    assert predictor.ttft_corrections[Tier.STANDARD].num_observations == 20


def test_a_colocated_steps_decode_batch_is_priced_out_of_its_prefill() -> None:
    """A colocated step that prefilled 300 tokens beside a decode batch of 8 requests over 4,000 tokens:
    the prefill fit learns the step less the batch's price without the per-step constant, as it learns
    the same prefill run alone."""
    mixed, alone = (LatencyPredictor(8, 4096) for _ in range(2))
    for predictor in (mixed, alone):
        for _ in range(50):
            predictor.observe_decode(8, 4000, 0.030)
    _, per_request, per_context = mixed.decode.coefficients
    riders = per_request * 8 + per_context * 4000
    assert 0 < riders < 0.030
    for tokens in (100, 300, 500) * 20:
        mixed.observe_prefill(tokens, 0, 0.02 + 1e-4 * tokens + riders, 0, 0.01 + 1e-4 * tokens + riders, 8, 4000)
        alone.observe_prefill(tokens, 0, 0.02 + 1e-4 * tokens, 0, 0.01 + 1e-4 * tokens)
    assert mixed.prefill.coefficients == pytest.approx(alone.prefill.coefficients)
    assert mixed.prefill_scale(0) == pytest.approx(alone.prefill_scale(0))
    before = mixed.prefill.num_observations
    mixed.observe_prefill(100, 0, riders / 2, 0, 0.0, 8, 4000)  # less than its decode batch's price: not learned
    assert mixed.prefill.num_observations == before


def test_a_decode_step_with_cpu_time_fits_the_cpu_time_and_scales_by_the_wall_clock() -> None:
    """Colocated decode steps stretched to 3x their CPU time while the API process decodes photos on the
    same cores: the fit learns the CPU time (a fit of wall-clock steps would keep the stretch), the worker's scale
    the stretch, so the predicted step is the stretched one now and the fit's once the burst is over."""
    predictor = LatencyPredictor(8, 4096)
    for batch in (2, 4, 8, 16) * 30:
        cpu = 0.002 + 0.0005 * batch
        predictor.observe_decode(batch, 100 * batch, 3 * cpu, 0, cpu)
    assert predictor.decode.predict((1.0, 8, 800)) == pytest.approx(0.002 + 0.0005 * 8, rel=0.05)
    assert predictor.decode_scale(0) == pytest.approx(3.0, rel=0.05)
    wall_only = LatencyPredictor(8, 4096)
    for batch in (2, 4, 8, 16) * 30:
        wall_only.observe_decode(batch, 100 * batch, 3 * (0.002 + 0.0005 * batch), 0)
    assert wall_only.decode.predict((1.0, 8, 800)) == pytest.approx(3 * (0.002 + 0.0005 * 8), rel=0.05)


def test_the_ratio_correction_is_bounded_and_validated() -> None:
    correction = RatioCorrection(weight=0.5, low=0.5, high=4.0)
    for _ in range(40):
        correction.observe(100.0, 1.0)
    assert correction.value == pytest.approx(4.0)
    correction.observe(0.0, 1.0)
    correction.observe(float("nan"), 1.0)
    assert correction.num_observations == 40
    with pytest.raises(ValueError, match="weight"):
        RatioCorrection(weight=0.0)
    with pytest.raises(ValueError, match="low"):
        RatioCorrection(low=2.0)


def test_a_correction_without_new_observations_decays_back_to_one() -> None:
    """A tier whose requests are all refused teaches nothing: its stale factor must fade, or it
    would stay locked out."""
    now = [0.0]
    correction = RatioCorrection(weight=1.0, half_life_s=10.0, grace_s=5.0, clock=lambda: now[0])
    correction.observe(4.0, 1.0)
    now[0] = 5.0  # within the grace: requests finishing seconds apart keep the full factor
    assert correction.value == pytest.approx(4.0)
    now[0] = 15.0
    assert correction.value == pytest.approx(2.0)
    now[0] = 105.0
    assert correction.value == pytest.approx(1.0, abs=0.01)
    correction.observe(3.0, 1.0)  # weight 1: the new ratio replaces the decayed one
    assert correction.value == pytest.approx(3.0)


class _Client:
    """The one method of EngineClient the controller uses, over a real LoadLedger."""

    def __init__(self, router: LoadLedger) -> None:
        self.router = router

    def load_view(self, tier: Tier, num_tokens: int, max_tokens: int) -> LoadView:
        return self.router.view(tier, Route(0, 0))


def _queued_router(tokens_per_rank: dict[int, int]) -> LoadLedger:
    router = LoadLedger(1, 1, 1000)
    for rank, tokens in tokens_per_rank.items():
        router.dispatched(f"r{rank}", 0, 0, tokens, 1, tier=Tier(rank))
    return router


def test_the_queue_ahead_counts_only_the_tier_and_tighter_ones() -> None:
    router = _queued_router({0: 100, 1: 1000, 2: 10_000})
    assert router.view(Tier(0), Route(0, 0)).ahead.tokens == 100
    assert router.view(Tier(1), Route(0, 0)).ahead.tokens == 1100
    assert router.view(Tier(2), Route(0, 0)).ahead.tokens == 11_100
    router.prefilled("r1")
    assert router.view(Tier(2), Route(0, 0)).ahead.requests == 2 and router.queued() == (2, 10_100)


def test_a_predicted_ttft_miss_is_a_429_naming_the_slo_and_the_excess() -> None:
    cfg = load_config(None, {"slo.tiers.interactive": {"ttft_ms": 50, "tpot_ms": 100}})
    controller = AdmissionController(cfg)
    client = _Client(_queued_router({0: 8000}))  # 8000 tokens of interactive work ahead: ~0.17 s predicted
    with pytest.raises(Rejection) as info:
        controller.admit(client, Tier.INTERACTIVE, 100, 0, 16)  # type: ignore[arg-type]
    r = info.value
    assert (r.status, r.reason) == (429, "ttft_slo") and r.retry_after_s is not None and r.retry_after_s >= 1
    assert "interactive tier" in r.message and "TTFT SLO of 0.050 s" in r.message
    assert re.search(r"by \d+ ms \(\d+ %", r.message), r.message  # the excess in ms, not "by 0.1xx s"
    # standard sees the same queue ahead (interactive work), but its SLO is looser: admitted
    assert controller.admit(client, Tier.STANDARD, 100, 0, 16) is not None  # type: ignore[arg-type]
    # batch is never refused for latency, whatever the queue
    heavy = _Client(_queued_router({0: 10**7}))
    assert controller.admit(heavy, Tier.BATCH, 100, 0, 16).ttft_s > 60  # type: ignore[arg-type,union-attr]


def test_with_prediction_off_nothing_is_refused_for_latency() -> None:
    cfg = load_config(None, {"admission.predict": False})
    controller = AdmissionController(cfg)
    heavy = _Client(_queued_router({0: 10**6}))
    assert controller.admit(heavy, Tier.INTERACTIVE, 100, 0, 16) is not None  # type: ignore[arg-type]


def test_measured_steps_refit_the_predictor() -> None:
    controller = AdmissionController(load_config(None))
    for i in range(40):
        tokens = 100 + 97 * i
        controller.on_step("prefill", 0, messages.StepTiming("prefill", 0.01 + 1e-4 * tokens, 2, tokens))
        controller.on_step("decode", 0, messages.StepTiming("decode", 0.02 + 0.001 * (i % 8), 1 + i % 8, 500 * (1 + i % 5)))
    assert controller.predictor.prefill_seconds(2000, 0) == pytest.approx(0.21, rel=0.05)
    report = controller.predictor.report()
    assert report["prefill"]["observations"] == 40 and report["decode"]["observations"] == 40  # type: ignore[index]
    assert controller.predictor.decode.predict((1.0, 4, 1000)) == pytest.approx(0.024, rel=0.1)


def test_a_profile_file_sets_the_starting_coefficients(tiny_llava: Path, tmp_path: Path) -> None:
    """admission.profile: the predictor starts from the profile's prefill/encode/decode points."""
    profile = {
        "format": "mm-serve-profile/1", "name": "t", "memory_bytes": 1e9, "model": str(tiny_llava),
        "prefill": [{"tokens": n, "batch": b, "seconds": 0.01 + 2e-4 * n * b} for n in (64, 256, 1024) for b in (1, 2)],
        "encode": [{"images": i, "seconds": 0.01 + 0.05 * i} for i in (1, 2, 4)],
        "decode": [{"batch": b, "context": c, "seconds": 0.005 + 1e-3 * b} for b in (1, 4, 16) for c in (128, 512)],
    }
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    controller = AdmissionController(load_config(None, {"admission.profile": str(path)}))
    predictor = controller.predictor
    assert predictor.prefill_seconds(1000, 0) == pytest.approx(0.21, rel=0.1)
    assert predictor.prefill_seconds(0, 2) == pytest.approx(0.11, rel=0.15)
    assert predictor.decode.predict((1.0, 8, 8 * 256)) == pytest.approx(0.013, rel=0.15)
    with pytest.raises(ProfileError, match="cannot read profile"):
        AdmissionController(load_config(None, {"admission.profile": str(tmp_path / "missing.json")}))


class _CachedClient(_Client):
    """A client whose chosen prefill worker holds ``cached`` tokens (and one image) of the prompt."""

    def __init__(self, router: LoadLedger, cached: int) -> None:
        super().__init__(router)
        self.cached = cached

    def load_view(self, tier: Tier, num_tokens: int, max_tokens: int, inputs: object = None) -> LoadView:
        view = self.router.view(tier, Route(0, 0))
        return view if inputs is None else dataclasses.replace(view, cached_tokens=self.cached, cached_images=1)


def test_a_prompt_the_prefill_worker_holds_is_predicted_without_its_cached_part() -> None:
    cfg = load_config(None)
    controller = AdmissionController(cfg)
    client = _CachedClient(_queued_router({}), cached=592)
    tier = Tier.STANDARD
    whole = controller.predict(client, tier, 600, 1, 16)  # type: ignore[arg-type]
    cached = controller.predict(client, tier, 600, 1, 16, inputs=object())  # type: ignore[arg-type]
    assert whole is not None and cached is not None
    predictor = controller.predictor
    assert cached.ttft_s == pytest.approx(predictor.prefill_seconds(8, 0) + predictor.overhead_s)  # 8 tokens, no image
    assert whole.ttft_s == pytest.approx(predictor.prefill_seconds(600, 1) + predictor.overhead_s)
    assert cached.ttft_s < whole.ttft_s


def test_a_request_alone_is_admitted_whatever_a_drifted_predictor_says() -> None:
    """A fit gone pessimistic (slow steps seen under load) must not refuse an idle service
    forever: alone, a request is admitted, and its steps correct the fit."""
    cfg = load_config(None)
    controller = AdmissionController(cfg)
    for _ in range(50):
        controller.predictor.observe_decode(1, 100, 2.0)  # 2 s decode steps
    idle = _Client(_queued_router({}))
    prediction = controller.admit(idle, Tier.STANDARD, 100, 0, 16)  # type: ignore[arg-type]
    assert prediction is not None and prediction.idle and prediction.tpot_s > 1.0
    with pytest.raises(Rejection, match="TPOT"):
        controller.admit(_Client(_queued_router({1: 100})), Tier.STANDARD, 100, 0, 16)  # type: ignore[arg-type]


def test_a_looser_tier_is_refused_when_it_would_slow_a_tighter_one_past_its_tpot_slo() -> None:
    """Every request on a decode worker gets the same step: a standard request that would make
    the step slower than the interactive TPOT SLO is refused while interactive requests run
    there, and admitted once they are gone."""
    cfg = load_config(None, {"slo.tiers.interactive": {"ttft_ms": 1000, "tpot_ms": 20},
                             "slo.tiers.standard": {"ttft_ms": 4000, "tpot_ms": 200}, "admission.margin": 0.0})
    controller = AdmissionController(cfg)
    for _ in range(50):  # 30 ms decode steps: within standard's 200 ms, over interactive's 20 ms
        controller.predictor.observe_decode(4, 1000, 0.03)
    router = _queued_router({})
    router.dispatched("running-interactive", 0, 0, 100, 1, tier=Tier(0))
    router.prefilled("running-interactive")
    client = _Client(router)
    with pytest.raises(Rejection, match="serving interactive requests") as info:
        controller.admit(client, Tier.STANDARD, 100, 0, 16)  # type: ignore[arg-type]
    assert info.value.reason == "tpot_slo"
    # a one-token answer has no TPOT; batch is never refused for latency
    assert controller.admit(client, Tier.STANDARD, 100, 0, 1) is not None  # type: ignore[arg-type]
    assert controller.admit(client, Tier.BATCH, 100, 0, 16) is not None  # type: ignore[arg-type]
    router.finished("running-interactive")
    router.dispatched("other", 0, 0, 100, 1, tier=Tier(1))  # not idle, but no interactive request there now
    assert controller.admit(client, Tier.STANDARD, 100, 0, 16) is not None  # type: ignore[arg-type]


def test_a_negative_margin_refuses_below_the_slo_and_says_so() -> None:
    cfg = load_config(None, {"slo.tiers.interactive": {"ttft_ms": 1000, "tpot_ms": 100}, "admission.margin": -0.5})
    controller = AdmissionController(cfg)
    for _ in range(50):
        controller.predictor.observe_decode(4, 1000, 0.07)  # 70 ms steps: under the SLO, over half of it
    with pytest.raises(Rejection) as info:
        controller.admit(_Client(_queued_router({1: 10})), Tier.INTERACTIVE, 100, 0, 16)  # type: ignore[arg-type]
    assert re.search(r"the predicted TPOT is 0\.0\d\d s, \d\d % under its TPOT SLO of 0\.100 s", info.value.message)
    assert "refuses above 50 % of the SLO" in info.value.message


class _TwoPrefillClient:
    """load_views over a real LoadLedger with two prefill workers and one decode worker."""

    def __init__(self, router: LoadLedger) -> None:
        self.router = router

    def load_views(self, tier: Tier, num_tokens: int, max_tokens: int) -> list[LoadView]:
        return [self.router.view(tier, Route(p, 0)) for p in (0, 1)]


def test_the_early_check_refuses_only_what_every_prefill_worker_rules_out() -> None:
    """Before a call's images are decoded: refused only when the queue on *each* prefill worker
    already puts a one-token prompt over the threshold, since the router may pick either."""
    cfg = load_config(None, {"slo.tiers.interactive": {"ttft_ms": 50, "tpot_ms": 100}})
    controller = AdmissionController(cfg)
    router = LoadLedger(2, 1, 1000)
    router.dispatched("a", 0, 0, 8000, 1, tier=Tier(0))  # interactive work ahead on prefill 0 only
    router.dispatched("b", 1, 0, 50, 1, tier=Tier(2))  # a little batch-tier work on prefill 1
    client = _TwoPrefillClient(router)
    interactive = Tier.INTERACTIVE
    controller.precheck(client, interactive, 16)  # type: ignore[arg-type]  # prefill 1 could still make it
    router.dispatched("c", 1, 0, 8000, 1, tier=Tier(0))
    with pytest.raises(Rejection) as info:
        controller.precheck(client, interactive, 16)  # type: ignore[arg-type]
    assert info.value.reason == "ttft_slo" and info.value.retry_after_s is not None
    controller.precheck(client, Tier.BATCH, 16)  # type: ignore[arg-type]  # batch: never


def test_the_early_check_counts_the_images_no_cache_can_hold() -> None:
    """A little interactive work queued on each prefill worker: a text call passes the early
    check, a call bringing two unseen images of 2,000 tokens each (certain work) is refused."""
    cfg = load_config(None, {"slo.tiers.interactive": {"ttft_ms": 50, "tpot_ms": 100}})
    controller = AdmissionController(cfg)
    router = LoadLedger(2, 1, 1000)
    router.dispatched("a", 0, 0, 500, 1, tier=Tier(0))
    router.dispatched("b", 1, 0, 500, 1, tier=Tier(0))
    client = _TwoPrefillClient(router)
    interactive = Tier.INTERACTIVE
    controller.precheck(client, interactive, 16)  # type: ignore[arg-type]
    assert controller.predictor.prefill_seconds(500 + 4000, 2) > 0.04  # over the 40 ms threshold
    with pytest.raises(Rejection, match="interactive tier"):
        controller.precheck(client, interactive, 16, tokens=4000, images=2)  # type: ignore[arg-type]


def test_seen_images_counts_each_url_once_and_forgets_the_oldest() -> None:
    from mm_serve.admission.seen_images import SeenImages

    seen = SeenImages(capacity=2)
    assert seen.count_unseen(["data:a", "data:b", "data:a"]) == 2
    assert seen.count_unseen(["data:a"]) == 0  # a is now the most recent
    assert seen.count_unseen(["data:c"]) == 1  # evicts b
    assert seen.count_unseen(["data:b", "data:c"]) == 1  # b was forgotten, c was not
    with pytest.raises(ValueError, match="capacity"):
        SeenImages(capacity=0)


def test_the_early_check_refuses_on_tpot_too() -> None:
    """70 ms decode steps on a busy decode worker: an interactive call (TPOT SLO 50 ms) is refused
    before its images are decoded, whichever prefill worker it would go to; a one-token one passes."""
    cfg = load_config(None, {"slo.tiers.interactive": {"ttft_ms": 4000, "tpot_ms": 50}})
    controller = AdmissionController(cfg)
    for _ in range(50):
        controller.predictor.observe_decode(4, 1000, 0.07)
    router = LoadLedger(2, 1, 1000)
    router.dispatched("a", 0, 0, 50, 1, tier=Tier(1))
    client = _TwoPrefillClient(router)
    interactive = Tier.INTERACTIVE
    with pytest.raises(Rejection) as info:
        controller.precheck(client, interactive, 16)  # type: ignore[arg-type]
    assert info.value.reason == "tpot_slo" and "TPOT SLO of 0.050 s" in info.value.message
    controller.precheck(client, interactive, 1)  # type: ignore[arg-type]


def test_the_spread_of_recent_ratios_sets_a_stricter_ttft_rule() -> None:
    """Measured TTFTs spread around the predictions (some 2-3x): a prediction at 60 % of
    the SLO passes the margin rule but, scaled by the 90th-percentile spread, would be late:
    refused, with a message that says why; with too few observations there is no spread."""
    correction = RatioCorrection(clock=lambda: 0.0)
    assert correction.spread(0.9) == 1.0
    for i in range(40):
        correction.observe(2.0 if i % 4 == 0 else 1.0, 1.0)  # a quarter of them 2x the rest
    assert correction.spread(0.9) == pytest.approx(2.0)
    assert correction.spread(0.5) == 1.0
    with pytest.raises(ValueError, match="quantile"):
        correction.spread(0.2)

    cfg = load_config(None, {"slo.tiers.interactive": {"ttft_ms": 1000, "tpot_ms": 100}})
    controller = AdmissionController(cfg)
    interactive = Tier.INTERACTIVE
    prediction = dataclasses.replace(Prediction(0.6, 0.01, 0.3), tier=Tier(0))
    assert controller._ttft_refusal(interactive, prediction) is None  # no spread yet; 0.6 s < 0.8 s
    for i in range(40):
        controller.predictor.ttft_corrections[0].observe(0.5 if i % 3 else 1.5, 0.5)  # a third 3x late
    refused = controller._ttft_refusal(interactive, prediction)
    assert refused is not None and "at the 90th percentile" in refused[0] and refused[1] > 0


def test_the_time_a_call_has_already_waited_counts_in_its_ttft() -> None:
    """A call that waited 0.9 s in a busy front end before its admission cannot meet a 1 s TTFT
    SLO however short the queue: refused, and the time is in the prediction and the message."""
    cfg = load_config(None, {"slo.tiers.interactive": {"ttft_ms": 1000, "tpot_ms": 100}})
    controller = AdmissionController(cfg)
    client = _Client(_queued_router({1: 10}))  # not idle
    interactive = Tier.INTERACTIVE
    fresh = controller.admit(client, interactive, 20, 0, 16)  # type: ignore[arg-type]
    assert fresh is not None and fresh.waited_s == 0.0
    with pytest.raises(Rejection, match="the predicted TTFT is 0.9"):
        controller.admit(client, interactive, 20, 0, 16, waited_s=0.9)  # type: ignore[arg-type]
    two = LoadLedger(2, 1, 1000)
    two.dispatched("s", 0, 0, 10, 1, tier=Tier(1))
    controller.precheck(_TwoPrefillClient(two), interactive, 16)  # type: ignore[arg-type]
    with pytest.raises(Rejection):
        controller.precheck(_TwoPrefillClient(two), interactive, 16, waited_s=0.9)  # type: ignore[arg-type]


def test_a_grammar_compile_counts_in_the_ttft_and_is_not_learned_as_queue_or_prefill() -> None:
    """A call whose grammar took the front end 0.95 s to compile (its prefill worker compiles it again
    before the first token) is predicted that much later and refused for a 1 s TTFT SLO; a finished
    request's span less its grammar time is what teaches the TTFT correction (its compile is no sign
    that the queue or the prefill run slow)."""
    cfg = load_config(None, {"slo.tiers.interactive": {"ttft_ms": 1000, "tpot_ms": 100}})
    controller = AdmissionController(cfg)
    client = _Client(_queued_router({1: 10}))  # not idle
    plain = controller.admit(client, Tier.INTERACTIVE, 20, 0, 16)  # type: ignore[arg-type]
    assert plain is not None and plain.grammar_s == 0.0
    with pytest.raises(Rejection, match=f"the predicted TTFT is {plain.ttft_s + 0.95:.3f} s"):
        controller.admit(client, Tier.INTERACTIVE, 20, 0, 16, grammar_s=0.95)  # type: ignore[arg-type]
    predictor = LatencyPredictor(prefill_batch_size=8, prefill_token_budget=4096)
    p = dataclasses.replace(predictor.predict(QueueAhead(2, 500, 2), 250, 1, 10, 3000), grammar_s=0.4)
    for _ in range(30):
        predictor.observe_finished(p, prefill_span_s=predictor.transit_s + p.ttft_base_s + 0.4, tpot_s=None)
    assert predictor.ttft_corrections[Tier.STANDARD].value == pytest.approx(1.0, abs=0.02)


def test_with_the_batch_in_progress_known_ttft_is_its_rest_then_the_batches_up_to_its_own() -> None:
    """A prefill worker that reports its batches: the new request waits for what is left of the
    batch in progress (the fit's seconds for it less the time it has run), then for the full
    batches of work ahead, then its own batch, which also takes the looser work queued and the
    work expected to arrive until it starts, up to the batch size (the scheduler's mates)."""
    predictor = LatencyPredictor(prefill_batch_size=4, prefill_token_budget=10_000)
    c, per_token, per_image = predictor.prefill.coefficients

    def seconds(tokens: float, images: float) -> float:
        return c + per_token * tokens + per_image * images

    running = QueueAhead(2, 400, 2)
    rest = seconds(400, 2) - 0.001
    assert predictor.remaining_seconds(running, 0.001) == pytest.approx(rest)
    assert predictor.remaining_seconds(running, 10.0) == 0.0  # over its prediction: about to end
    assert predictor.remaining_seconds(running, 0.001, scale=2.0) == pytest.approx(2 * seconds(400, 2) - 0.001)
    # 5 ahead: one full batch of 4, then its own batch with the fifth, itself and 2 of the 3 looser
    ahead, looser = QueueAhead(5, 1000, 5), QueueAhead(3, 300, 0)
    p = predictor.predict(ahead, 250, 1, 1, 250, looser, tier=Tier(1), running=running, running_elapsed_s=0.001)
    full_batch = seconds(800, 4)
    own_batch = seconds(200 + 250 + 200, 1 + 1)
    assert p.ttft_base_s == pytest.approx(rest + full_batch + own_batch)
    assert p.ttft_s == pytest.approx(p.ttft_base_s + predictor.overhead_s)
    assert p.queue_s == pytest.approx(p.ttft_base_s - seconds(250, 1))
    # nothing ahead or running: its batch starts now, so nothing arrives to join it
    alone = predictor.predict(QueueAhead(0, 0, 0), 250, 1, 1, 250, QueueAhead(0, 0, 0), running=QueueAhead(0, 0, 0),
                              arrivals=QueueAhead(50, 12_500, 50), arrivals_window_s=5.0)
    assert alone.ttft_base_s == pytest.approx(seconds(250, 1))
    # 10 req/s arriving while the batch in progress ends: about rest * 10 of them join its batch
    joined = predictor.predict(QueueAhead(0, 0, 0), 250, 1, 1, 250, QueueAhead(0, 0, 0), running=running,
                               running_elapsed_s=0.001, arrivals=QueueAhead(50, 12_500, 50), arrivals_window_s=5.0)
    expected = rest * 10
    assert joined.ttft_base_s == pytest.approx(rest + seconds(250 + 250 * expected, 1 + expected))


def _promising_router(standard_tokens: int, arrived_ago_s: float, num_prefill: int = 1) -> LoadLedger:
    """Prefill workers that report their batches (none in progress); one queued standard request on the first."""
    router = LoadLedger(num_prefill, 1, 1000)
    for i in range(num_prefill):
        router.batch_started(i, [])
    router.dispatched("s", 0, 0, standard_tokens, 1, tier=Tier(1), arrived_at=time.monotonic() - arrived_ago_s)
    return router


def test_a_tighter_call_that_would_make_a_queued_looser_one_late_is_refused() -> None:
    """An interactive call is prefilled before the standard requests queued on its worker; when
    its prefill would push the first token of one that is on time past its TTFT SLO, it is
    refused (429 ``ttft_slo`` naming the standard request), unless ``admission.protect_admitted``
    is false; a smaller call that leaves it on time is admitted, and a queued request that is
    already predicted late protects nothing."""
    overrides = {"slo.tiers.interactive": {"ttft_ms": 500, "tpot_ms": 100},
                 "slo.tiers.standard": {"ttft_ms": 500, "tpot_ms": 1000}}
    controller = AdmissionController(load_config(None, overrides))
    interactive = Tier.INTERACTIVE
    c, per_token, _ = controller.predictor.prefill.coefficients
    client = _Client(_promising_router(15_000, 0.0))  # its first token in ~0.32 s: 0.18 s of slack
    small = controller.admit(client, interactive, 8000, 0, 16)  # type: ignore[arg-type]
    assert small is not None and small.makes_late is None  # 0.164 s more: still on time
    with pytest.raises(Rejection) as info:
        controller.admit(client, interactive, 12_000, 0, 16)  # type: ignore[arg-type]
    assert (info.value.status, info.value.reason) == (429, "ttft_slo")
    assert "before a queued standard tier request" in info.value.message, info.value.message
    prediction = controller.predict(client, interactive, 12_000, 0, 16)  # type: ignore[arg-type]
    assert prediction is not None and prediction.makes_late is not None
    rank, late, due = prediction.makes_late.tier, prediction.makes_late.first_token_in_s, prediction.makes_late.due_in_s
    first = controller.predictor.queue_seconds(QueueAhead(1, 15_000, 0))  # in token-budget batches
    assert rank == 1 and late == pytest.approx(first + c + per_token * 12_000, rel=1e-6)
    assert 0.49 < due <= 0.5 and late > due
    # the standard request's own prediction is not affected: nothing looser is queued
    assert controller.predict(client, Tier.STANDARD, 100, 0, 16).makes_late is None  # type: ignore[arg-type,union-attr]
    # already late (arrived 0.4 s ago, first token in 0.3 s): refusing saves nothing
    assert controller.admit(_Client(_promising_router(15_000, 0.4)), interactive, 12_000, 0, 16) is not None  # type: ignore[arg-type]
    # standard's requests missing their SLO tighten what is promised to them, and the message says so
    for _ in range(3):
        controller.feedback.factors[(Tier(1), "ttft")].observe(late=True)
    factor = controller.limit_factor(1, "ttft")
    assert factor < 0.8
    with pytest.raises(Rejection) as tightened:
        controller.admit(client, interactive, 6000, 0, 16)  # type: ignore[arg-type]  # on time without the tightening
    assert f"TTFT SLO x {factor:.2f}, tightened while the standard tier's requests miss" in tightened.value.message
    assert "service_tier 'flex'" in tightened.value.message
    for _ in range(100):
        controller.feedback.factors[(Tier(1), "ttft")].observe(late=False)
    off = AdmissionController(load_config(None, {**overrides, "admission.protect_admitted": False}))
    assert off.admit(client, interactive, 12_000, 0, 16) is not None  # type: ignore[arg-type]
    # the early check (before images are decoded) refuses it too when both prefill workers hold such a request
    router = _promising_router(15_000, 0.0, num_prefill=2)
    router.dispatched("s1", 1, 0, 15_000, 1, tier=Tier(1), arrived_at=time.monotonic())
    with pytest.raises(Rejection) as early:
        controller.precheck(_TwoPrefillClient(router), interactive, 16, tokens=12_000)  # type: ignore[arg-type]
    assert early.value.reason == "ttft_slo" and "queued standard tier request" in early.value.message
    router.finished("s1")  # prefill 1 has nothing queued: the router may send it there
    controller.precheck(_TwoPrefillClient(router), interactive, 16, tokens=12_000)  # type: ignore[arg-type]


def test_a_decode_worker_whose_last_steps_ran_longer_than_the_fit_prices_them_is_predicted_slower() -> None:
    """Each decode step is first compared with the fit's price for it (before the fit learns it):
    a worker whose steps suddenly take twice as long (a prefill burst on its shared core) has
    its TPOT predicted about twice as long within a few dozen steps, before the fit (about the
    last 100 steps, pulled toward its start) has moved that far; other workers are unaffected."""
    predictor = LatencyPredictor(prefill_batch_size=1, prefill_token_budget=4096)
    for _ in range(300):  # a steady worker 0 at 20 ms per step of 8 requests
        predictor.observe_decode(8, 4000, 0.020, worker=0)
    before = predictor.predict(QueueAhead(0, 0, 0), 100, 0, 8, 4000, decode_worker=0)
    assert predictor.decode_scale(0) == pytest.approx(1.0, abs=0.05)
    for _ in range(30):  # its steps now take 40 ms
        predictor.observe_decode(8, 4000, 0.040, worker=0)
    fit_only = predictor.decode.predict((1.0, 8, 4000))
    assert fit_only < 0.035  # the fit has not caught up
    after = predictor.predict(QueueAhead(0, 0, 0), 100, 0, 8, 4000, decode_worker=0)
    assert after.tpot_s == pytest.approx(0.040, rel=0.1) and after.tpot_s > 1.5 * before.tpot_s
    assert after.tpot_step_s == pytest.approx(predictor.decode_scale(0) * fit_only)
    assert predictor.predict(QueueAhead(0, 0, 0), 100, 0, 8, 4000, decode_worker=1).tpot_s == pytest.approx(fit_only)
    assert predictor.report()["decode"]["worker_speed"] == {"0": round(predictor.decode_scale(0), 4)}  # type: ignore[index]


def test_each_prefill_worker_learns_its_own_speed() -> None:
    """Prefill worker 1 shares its core with the decode worker and runs its batches 1.7x as long
    as worker 0: the shared fit learns the shape, each worker's speed how much slower it is
    than the fit, and its predictions scale with it (TTFT and the rest of its batch in progress)."""
    predictor = LatencyPredictor(prefill_batch_size=8, prefill_token_budget=4096)
    rng = random.Random(3)
    for _ in range(200):
        tokens = rng.choice((250, 500, 750))
        worker = rng.randrange(2)
        predictor.observe_prefill(tokens, tokens // 250, (0.005 + 4e-4 * tokens) * (1.7 if worker else 1.0), worker)
    ratio = predictor.prefill_scale(1) / predictor.prefill_scale(0)
    assert ratio == pytest.approx(1.7, rel=0.1)
    assert predictor.prefill_scale(None) == 1.0 and predictor.prefill_scale(7) == 1.0  # not measured: the fit
    on = {w: predictor.predict(QueueAhead(1, 250, 1), 250, 1, 1, 250, running=QueueAhead(0, 0, 0), prefill_worker=w)
          for w in (0, 1)}
    assert on[1].ttft_base_s / on[0].ttft_base_s == pytest.approx(ratio)
    assert predictor.prefill_scale(0) * predictor.prefill_seconds(500, 2) == pytest.approx(0.205, rel=0.1)
    speeds = predictor.report()["prefill"]["worker_speed"]  # type: ignore[index]
    assert set(speeds) == {"0", "1"} and speeds["1"] > speeds["0"]  # type: ignore[operator]


def test_a_request_delayed_by_a_worker_fault_teaches_nothing() -> None:
    """A request moved to a new attempt after its prefill worker died waited for the restart: 50x
    its prediction. Learned, it would set the corrections and the attainment feedback against an
    idle, recovered service; it leaves them as they were, and the same request without the fault
    is learned."""
    controller = AdmissionController(load_config(None))
    prediction = controller.predictor.predict(QueueAhead(0, 0, 0), 250, 1, 1, 250)
    state = RequestState("r", 10, None)  # type: ignore[arg-type]
    controller.remember(state.request_id, prediction)
    state.tier = Tier.INTERACTIVE
    state.arrival_time = state.submitted_at = 100.0
    state.first_token_time = 100.0 + 50 * prediction.ttft_base_s + 2.0  # past the 1 s SLO
    state.token_times = [state.first_token_time, state.first_token_time + 0.01, state.first_token_time + 0.02]
    state.finish_reason = "length"
    state.events = {"prefill_queued": 100.0, "prefill_end": 101.0}
    state.delayed_by_fault = True
    controller.on_finished(state)
    predictor = controller.predictor
    assert [c.num_observations for c in predictor.ttft_corrections] == [0, 0, 0]
    assert predictor.tpot_correction.num_observations == 0 and predictor.overhead_s == DEFAULT_OVERHEAD_S
    assert controller.feedback_report()["interactive"]["ttft"] == {"factor": 1.0, "late": 0, "in_time": 0}
    state.delayed_by_fault = False
    controller.remember(state.request_id, prediction)  # each finish takes the prediction it learns from
    controller.on_finished(state)
    assert predictor.ttft_corrections[prediction.tier].num_observations == 1
    assert controller.feedback_report()["interactive"]["ttft"]["late"] == 1  # type: ignore[index]


def test_a_structured_outputs_tpot_is_learned_from_its_second_token() -> None:
    """A structured output's decode worker builds its grammar's matcher when it takes the request (a fresh
    grammar: the first import and compile, 0.7 s on the tiny model), inside the gap before its second
    token: its TPOT is learned from the second token on, and with 3 tokens (one gap left) not at all
    (counted from the first, the same gap is fitted as 1.45x slower steps: the last assertion)."""
    controller = AdmissionController(load_config(None))
    predictor = controller.predictor
    prediction = predictor.predict(QueueAhead(0, 0, 0), 250, 1, 1, 250)
    step = prediction.tpot_step_s
    for structured, tokens, learned in ((True, 3, 0), (True, 5, 1), (False, 5, 2)):
        state = RequestState("r", 10, None)  # type: ignore[arg-type]
        state.structured = structured
        controller.remember(state.request_id, prediction)
        state.arrival_time = state.submitted_at = 100.0
        state.first_token_time = 100.0 + prediction.ttft_base_s
        gaps = [0.7] + [step] * (tokens - 2)  # the grammar set up before the second token, then steps
        state.token_times = [state.first_token_time + sum(gaps[:k]) for k in range(tokens)]
        state.finish_reason = "length"
        state.events = {"prefill_queued": 100.0, "prefill_end": 100.1}
        controller.on_finished(state)
        assert predictor.tpot_correction.num_observations == learned
        if learned == 1:  # steps as predicted: no correction
            assert predictor.tpot_correction.value == pytest.approx(1.0)
    assert predictor.tpot_correction.value > 1.4  # the same gap counted as a step


def test_a_finished_request_teaches_the_span_from_its_dispatch_to_its_first_token() -> None:
    """What the prediction's queue + prefill part stands for is measured from the request's
    dispatch to its first token here (the batch in progress ahead of it, its own batch, both
    messages), not from when its worker read it: the correction learns that ratio and the
    overhead learns the time between its arrival and its dispatch less the wait already counted."""
    controller = AdmissionController(load_config(None))
    prediction = dataclasses.replace(controller.predictor.predict(QueueAhead(0, 0, 0), 250, 1, 1, 250), waited_s=0.01)
    state = RequestState("r", 10, None)  # type: ignore[arg-type]
    controller.remember(state.request_id, prediction)
    state.arrival_time, state.submitted_at = 100.0, 100.03
    state.first_token_time = 100.03 + 2.0 * prediction.ttft_base_s
    state.events = {"prefill_queued": 5.0, "prefill_end": 5.001}  # the worker read it late: not what counts
    controller.on_finished(state)
    predictor = controller.predictor
    base = prediction.ttft_base_s
    assert prediction.queue_s == 0  # it waited for nothing: its span less its prefill is transit
    assert predictor.transit_s == pytest.approx(TRANSIT_WEIGHT * base)
    correction = predictor.ttft_corrections[prediction.tier]
    measured = (2.0 * base - predictor.transit_s) / base  # the span less the transit, against the base
    assert correction.num_observations == 1 and correction.value == pytest.approx(measured ** correction.weight)
    overhead = DEFAULT_OVERHEAD_S + OVERHEAD_WEIGHT * (0.02 - DEFAULT_OVERHEAD_S)
    assert predictor.overhead_s == pytest.approx(overhead)
    later = predictor.predict(QueueAhead(0, 0, 0), 250, 1, 1, 250)
    assert later.ttft_s == pytest.approx(later.ttft_base_s * correction.value + predictor.transit_s + predictor.overhead_s)
    queued = predictor.predict(QueueAhead(3, 750, 3), 250, 1, 1, 250)
    assert queued.queue_s > 0
    controller.remember(state.request_id, queued)
    state.first_token_time = 100.03 + queued.ttft_base_s
    controller.on_finished(state)  # a request that waited: the transit stays, the correction learns
    assert predictor.transit_s == pytest.approx(TRANSIT_WEIGHT * base) and correction.num_observations == 2
    state.events = {}  # never prefilled (failed before): nothing learned
    controller.remember(state.request_id, queued)
    controller.on_finished(state)
    assert correction.num_observations == 2


def test_the_early_check_counts_the_text_after_a_new_image_and_never_more_than_the_prompt(tiny_llava: Path) -> None:
    """The early check's text tokens are a lower bound of what no cache can hold: only the text
    after the first image never sent before (a cached prefix may hold what comes before it),
    never more than that text's tokens in the templated prompt."""
    from mm_serve.inputs.input_processor import load_tokenizer
    from mm_serve.pipeline.chat_prompt import ChatPrompt
    from mm_serve.protocol.schemas import ChatMessage

    tokenizer = load_tokenizer(tiny_llava)
    question = "What colour is the large circle in the middle of this picture, and what is around it?"
    messages = [
        ChatMessage(role="system", content="You are a careful assistant who answers in one sentence."),
        ChatMessage(role="user", content=[{"type": "text", "text": "Look:"},  # type: ignore[list-item]
                                          {"type": "image_url", "image_url": {"url": "data:a"}},
                                          {"type": "text", "text": question}]),
    ]
    after = len(tokenizer.encode(question, add_special_tokens=False))
    assert after > 10
    prompt = ChatPrompt.parse(messages)
    assert prompt.uncached_text_floor([True], tokenizer) == after - 1
    assert prompt.uncached_text_floor([False], tokenizer) == 0  # a seen image: the cache may hold it all
    rendered = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False),
                                add_special_tokens=False)
    assert prompt.uncached_text_floor([True], tokenizer) <= len(rendered)


def test_a_paced_decode_step_is_predicted_as_at_least_the_interval_of_the_tightest_tier() -> None:
    """With decode pacing 0.7 and TPOT SLOs of 100 / 250 / 2,000 ms, a decode step whose work the
    fit prices at 10 ms is predicted at the paced interval: 70 ms for an interactive request or beside
    one, 175 ms for a standard one alone, 1 s (the cap) for a batch one alone; work slower than the
    interval is predicted as the work. Unpaced, the same fit predicts the work alone."""
    paced = LatencyPredictor(prefill_batch_size=8, prefill_token_budget=4096, decode_pacing=0.7,
                             tier_tpot_s=(0.1, 0.25, 2.0))
    unpaced = LatencyPredictor(prefill_batch_size=8, prefill_token_budget=4096)
    for predictor in (paced, unpaced):
        for _ in range(300):
            predictor.observe_decode(4, 2000, 0.010)
    work = unpaced.decode.predict((1.0, 4, 2000))
    assert work == pytest.approx(0.010, rel=0.05)

    def step(predictor: LatencyPredictor, tier: Tier, tightest: Tier | None, batch: int = 4) -> float:
        return predictor.predict(QueueAhead(0, 0, 0), 100, 0, batch, 2000, tier=tier, reserve=2,
                                 decode_tightest=tightest).tpot_step_s

    assert step(paced, Tier.INTERACTIVE, None) == pytest.approx(0.07)
    assert step(paced, Tier.STANDARD, None) == pytest.approx(0.175)
    assert step(paced, Tier.STANDARD, Tier.INTERACTIVE) == pytest.approx(0.07)
    assert step(paced, Tier.INTERACTIVE, Tier.STANDARD) == pytest.approx(0.07)
    assert step(paced, Tier.BATCH, None) == pytest.approx(1.0)
    prediction = paced.predict(QueueAhead(0, 0, 0), 100, 0, 4, 2000, tier=Tier.STANDARD, reserve=2)
    # the SLO rules judge the work (the interval is below every running request's SLO by construction)
    assert prediction.tpot_s == pytest.approx(0.175) and prediction.tpot_judged_s == pytest.approx(work)
    assert prediction.tpot_reserved_s == pytest.approx(paced.decode.predict((1.0, 6, 3000)))
    assert step(unpaced, Tier.STANDARD, None) == pytest.approx(work)
    unpaced_prediction = unpaced.predict(QueueAhead(0, 0, 0), 100, 0, 4, 2000)
    assert unpaced_prediction.tpot_judged_s == unpaced_prediction.tpot_s == pytest.approx(work)
    slow = paced.decode.predict((1.0, 400, 2000))  # 400 running requests: a step longer than 70 ms
    assert slow > 0.07 and step(paced, Tier.INTERACTIVE, None, batch=400) == pytest.approx(slow)
    fixed = LatencyPredictor(prefill_batch_size=8, prefill_token_budget=4096, decode_interval_s=0.075)
    fixed.decode = paced.decode
    assert step(fixed, Tier.STANDARD, None) == step(fixed, Tier.INTERACTIVE, Tier.BATCH) == pytest.approx(0.075)


def test_the_admission_controller_paces_as_the_decode_workers_do() -> None:
    """``scheduler.decode_step_pacing`` 0.7 with a 110 ms standard TPOT SLO: a standard request on an
    idle service is predicted at the 77 ms interval and admitted (the predictor used to learn the paced
    periods as step work and refuse it); the colocated mode, whose worker does not pace, predicts the
    work alone."""
    overrides = {"scheduler.decode_step_pacing": 0.7, "slo.tiers.standard.tpot_ms": 110, "admission.margin": 0.0}
    controller = AdmissionController(load_config(None, overrides))
    for _ in range(100):  # the decode worker reports its steps without the pacing sleep
        controller.predictor.observe_decode(1, 200, 0.008, worker=0)
    prediction = controller.admit(_Client(_queued_router({})), Tier.STANDARD, 100, 0, 16)  # type: ignore[arg-type]
    assert prediction is not None and prediction.tpot_step_s == pytest.approx(0.077)
    colocated = AdmissionController(load_config(None, {**overrides, "mode": "colocated"}))
    assert colocated.predictor.paced_step_s(Tier.STANDARD) == 0.0
    assert controller.predictor.paced_step_s(Tier.BATCH, Tier.STANDARD) == pytest.approx(0.077)
    # a fixed interval (configs/summarization.yaml's 75 ms) is priced the same way
    interval = AdmissionController(load_config(None, {"scheduler.decode_step_interval_ms": 75}))
    assert interval.predictor.paced_step_s(Tier.BATCH) == pytest.approx(0.075)


def test_under_pacing_a_tighter_tier_is_protected_by_the_work_not_by_a_looser_tiers_interval() -> None:
    """Pacing 0.7: after an interactive call, a standard request beside queued work and a batch request
    on an idle service are let through when their steps' work is far below the interactive TPOT SLO
    (the standard interval of 175 ms, or the batch one of 1 s, is not what the interactive request would
    get: the interval drops to 70 ms once it runs); the work itself still protects it."""
    overrides = {"scheduler.decode_step_pacing": 0.7}
    controller = AdmissionController(load_config(None, overrides))
    for _ in range(100):
        controller.predictor.observe_decode(2, 400, 0.008, worker=0)
    controller.note_call(Tier.INTERACTIVE)
    busy = _Client(_queued_router({1: 100}))
    assert controller.admit(busy, Tier.STANDARD, 100, 0, 16) is not None  # type: ignore[arg-type]
    controller.note_call(Tier.STANDARD)
    assert controller.hold_reason(_Client(_queued_router({})), Tier.BATCH, 100, 0, 16) is None  # type: ignore[arg-type]
    slow = AdmissionController(load_config(None, overrides))
    for _ in range(100):  # 90 ms steps of work: over the 80 ms the interactive tier allows
        slow.predictor.observe_decode(2, 400, 0.09, worker=0)
    router = _queued_router({})
    router.dispatched("running-interactive", 0, 0, 100, 1, tier=Tier.INTERACTIVE)
    router.prefilled("running-interactive")
    with pytest.raises(Rejection, match="serving interactive requests"):
        slow.admit(_Client(router), Tier.STANDARD, 100, 0, 16)  # type: ignore[arg-type]


@pytest.mark.parametrize("content", [None, '{"format": "mm-serve-pro'])
def test_serve_refuses_a_bad_admission_profile_before_any_worker_starts(
        tiny_llava: Path, tmp_path: Path, content: str | None) -> None:
    """A missing or truncated admission.profile is one line (exit 2), not a traceback after the workers started."""
    import os
    import subprocess
    import sys

    profile = tmp_path / "profile.json"
    if content is not None:
        profile.write_text(content)
    config = tmp_path / "c.yaml"
    config.write_text(f"admission:\n  profile: {profile}\n")
    done = subprocess.run([sys.executable, "-m", "mm_serve", "serve", "--model", str(tiny_llava), "--mode", "colocated",
                           "--port", "0", "--config", str(config)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MM_SERVE_PROFILE_DIR": str(tmp_path)})
    output = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in output and "starting colocated" not in output, output[-2000:]
    assert "mm-serve: error: admission.profile: " in output and str(profile) in output
