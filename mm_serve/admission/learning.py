"""What admission learns from the service: the predictor's fits and corrections, and each tier's
attainment feedback, fed by timed worker steps and finished requests.

:class:`AdmissionLearning` holds the state the admission rule
(:class:`~mm_serve.admission.controller.AdmissionController`) reads, behind one lock: the
listeners run on the engine client's receiver thread, the rule on the event loop.
"""

from __future__ import annotations

import threading

from mm_serve.admission.predictor import LatencyPredictor, Prediction
from mm_serve.admission.tier_feedback import TierFeedback
from mm_serve.config import ServiceConfig
from mm_serve.engine.request_state import RequestState
from mm_serve.ground.tiers import Tier
from mm_serve.planner.profile_file import load_profile
from mm_serve.runtime import messages
from mm_serve.runtime.lifetime import LifetimeEvent


class AdmissionLearning:
    """The predictor, the tiers' feedback, and the predictions of requests in flight.

    Raises (constructor):
        ProfileError: ``admission.profile`` cannot be read or is not a valid profile.
    """

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        paced = config.mode == "disaggregated"  # a colocated worker does not pace
        self.predictor = LatencyPredictor(config.scheduler.prefill_batch_size, config.scheduler.prefill_token_budget,
                                          config.scheduler.decode_step_pacing if paced else 0.0,
                                          [config.slo.of(tier).tpot_s for tier in Tier],
                                          config.scheduler.decode_step_interval_ms / 1000.0 if paced else 0.0)
        if config.admission.profile is not None:
            self.predictor.warm_start(load_profile(config.admission.profile))
        self.lock = threading.Lock()
        self.feedback = TierFeedback(config)
        self._predictions: dict[str, Prediction] = {}  # request id -> the prediction it was admitted on

    def limit_factor(self, tier: Tier, slo: str) -> float:
        """What the admission limits on the ``slo`` ("ttft" or "tpot") of ``tier`` are multiplied by
        now: the attainment feedback's factor (1.0 when the tier meets its aim, or with
        ``admission.attainment_feedback`` or ``admission.predict`` off: nothing it would scale)."""
        with self.lock:
            return self.feedback.factor(tier, slo)

    def feedback_report(self) -> dict[str, dict[str, object]]:
        """Per tier that can be refused: each SLO's limit factor as applied (:meth:`limit_factor`: 1.0
        with the feedback or prediction off), and the late and in-time requests seen (for /health)."""
        with self.lock:
            return self.feedback.report()

    def report(self) -> dict[str, object]:
        """The predictor's coefficients, corrections and their age (for /health), read under the lock
        (reading a fit may re-solve it)."""
        with self.lock:
            return self.predictor.report()

    def remember(self, request_id: str, prediction: Prediction) -> None:
        """Keep the prediction a request was admitted on, to learn from it when it finishes (one
        request per call is enough: the call's others are not remembered)."""
        with self.lock:
            self._predictions[request_id] = prediction

    def forget(self, request_id: str) -> None:
        """Drop a remembered prediction (its request was never submitted)."""
        with self.lock:
            self._predictions.pop(request_id, None)

    def on_step(self, role: str, index: int, step: messages.StepTiming) -> None:
        """Refit from one timed step of worker ``index`` of ``role`` (the engine client's step listener)."""
        with self.lock:
            if step.kind == "prefill":
                self.predictor.observe_prefill(step.tokens, step.images, step.seconds, index, step.cpu_seconds,
                                               step.decode_requests, step.decode_context)
            elif step.kind == "decode":
                self.predictor.observe_decode(step.requests, step.tokens, step.seconds, index, step.cpu_seconds)

    def on_finished(self, state: RequestState) -> None:
        """Refit the front-end overhead and the corrections from a finished request that was
        prefilled (its lifetime events say so) against its prediction: the measured span from its
        dispatch to its first token here (the queue and batch in progress ahead of it, its own
        batch, the messages both ways: what the prediction's queue + prefill part stands for), the
        overhead from its TTFT less that span and the wait before its prediction, and its TPOT (for a
        structured output, from its second token: the gap before it holds the decode worker's grammar
        compile).
        A request delayed by a worker fault (moved to a new attempt, or parked while a role had no
        ready worker: ``RequestState.delayed_by_fault``) teaches nothing: its latency measures the
        restart, and learning it would refuse most interactive calls to the recovered, idle
        service for seconds (TTFT corrections at their bound, the feedback at its floor)."""
        with self.lock:
            prediction = self._predictions.pop(state.request_id, None)
        if state.delayed_by_fault:
            return
        served = state.served_latency()
        if served is not None and state.tier is not None:
            with self.lock:
                self.feedback.observe(state.tier, *served)
        if state.first_token_time is None or LifetimeEvent.PREFILL_END.value not in state.events:
            return
        ttft, span = state.first_token_time - state.arrival_time, state.first_token_time - state.submitted_at
        # TPOT as decode steps make it: from the second token for a structured output (the gap before it
        # holds its decode worker's grammar setup, 0.68 s for a fresh grammar on the tiny model, which the
        # TPOT correction would fit as 1.45x slower steps)
        times = state.token_times[1:] if state.structured else state.token_times
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) >= 3 and state.error is None else None
        if prediction is None:  # a call's other requests (and calls with no worker ready at admission):
            return  # their wait in the dispatch hold is not known here, and one request per call is enough
        with self.lock:
            self.predictor.observe_overhead(ttft - span - prediction.waited_s)
            self.predictor.observe_finished(prediction, span, tpot)
