"""Admission by prediction: refuse at once what would miss its tier's SLO.

For each API call, :meth:`AdmissionController.admit` predicts the TTFT and TPOT of its
first request (:class:`~mm_serve.admission.predictor.LatencyPredictor`) on the workers the
router would pick now, and refuses the call (429, ``Retry-After``) when a prediction
exceeds its tier's SLO by more than ``admission.margin``, unless the workers it would go to
are idle: a request alone is never refused (refusing it protects no one, and a predictor
that had drifted pessimistic would otherwise refuse everything and never see a step again).
TTFT has a second rule, from the measured spread of the tier's recent predictions
(:meth:`AdmissionController._ttft_refusal`); TPOT also protects tighter tiers on the decode
worker, running there or sent lately, with room kept for :data:`DECODE_RESERVE` more requests
(:meth:`AdmissionController._protect_excess`). The ``batch`` tier is never
refused for latency (only the hard bounds apply to it; it waits in the dispatch hold instead,
:meth:`AdmissionController.hold_reason`), nor is anything with ``admission.predict`` false. The predictor learns from every timed worker step
(:meth:`on_step`) and every finished request (:meth:`on_finished`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import TypeVar

from mm_serve.admission.attainment_feedback import FEEDBACK_SLOS, AttainmentFeedback
from mm_serve.admission.predictor import LatencyPredictor, LateRequest, Prediction, QueueAhead
from mm_serve.admission.rejection import Rejection
from mm_serve.admission.tiers import TIERS, Tier, tier_slo
from mm_serve.config import ServiceConfig
from mm_serve.engine.engine_client import EngineClient
from mm_serve.engine.request_state import RequestState
from mm_serve.engine.router import ARRIVAL_WINDOW_S, LoadView, PrefillWork, Promise
from mm_serve.inputs.input_processor import ProcessedInputs
from mm_serve.planner.profile_file import load_profile
from mm_serve.runtime import messages
from mm_serve.runtime.lifetime import LifetimeEvent

NEVER_REFUSED = "batch"
DEMAND_WINDOW_S = 5.0  # a tier whose last call came this recently keeps its room on the decode workers
DECODE_RESERVE = 2  # requests of a tighter tier the decode step is kept room for (see _protect_excess)


class AdmissionController:
    """The predictor and the admission rule of one service (one per API app)."""

    def __init__(self, config: ServiceConfig) -> None:
        """Raises:
            ProfileError: ``admission.profile`` cannot be read or is not a valid profile.
        """
        self.config = config
        self.predictor = LatencyPredictor(config.scheduler.prefill_batch_size, config.scheduler.prefill_token_budget)
        if config.admission.profile is not None:
            self.predictor.warm_start(load_profile(config.admission.profile))
        self._lock = threading.Lock()
        self._last_call: list[float | None] = [None] * len(TIERS)  # monotonic time of each tier's last call
        self.feedback = {(rank, slo): AttainmentFeedback(tier_slo(name, config.slo).attainment)
                         for rank, name in enumerate(TIERS) for slo in FEEDBACK_SLOS}

    @property
    def _feedback_applied(self) -> bool:
        """Whether the attainment feedback's factors scale anything: it and prediction both on."""
        return self.config.admission.attainment_feedback and self.config.admission.predict

    def limit_factor(self, rank: int, slo: str) -> float:
        """What the admission limits on the ``slo`` ("ttft" or "tpot") of the tier of ``rank`` are
        multiplied by now: the attainment feedback's factor (1.0 when the tier meets its aim, or
        with ``admission.attainment_feedback`` or ``admission.predict`` off: nothing it would scale)."""
        with self._lock:
            return self._limit_factor_locked(rank, slo)

    def _limit_factor_locked(self, rank: int, slo: str) -> float:
        """:meth:`limit_factor`, for a caller that holds the lock."""
        return self.feedback[(rank, slo)].value if self._feedback_applied else 1.0

    def predict(self, client: EngineClient, tier: Tier, tokens: int, images: int, max_tokens: int,
                inputs: ProcessedInputs | None = None) -> Prediction | None:
        """The prediction for one request of ``tokens`` prompt tokens in ``tier``; None while a role has no
        ready worker (the request then waits for one, bounded by ``api.timeout_ms``). With its
        ``inputs``, the tokens and images the chosen prefill worker is believed to hold in its
        prefix cache are not counted in its own prefill."""
        view = client.load_view(tier.rank, tokens, max_tokens) if inputs is None else \
            client.load_view(tier.rank, tokens, max_tokens, inputs)
        return None if view is None else self._predict_in(view, tier, tokens, images)

    def _predict_in(self, view: LoadView, tier: Tier, tokens: int, images: int) -> Prediction:
        """The prediction for a prompt of ``tokens`` tokens and ``images`` images on the workers of
        ``view``: its cached part (as the view believes) left out of its prefill, the decode context
        that worker's pages in use plus the prompt."""
        context = view.decode_pages_used * self.config.kv_cache.page_size + tokens
        return self._predict_on(view, tier, tokens - view.cached_tokens, images - view.cached_images, context)

    def _predict_on(self, view: LoadView, tier: Tier, tokens: int, images: int, context: int) -> Prediction:
        """The prediction for ``tokens`` and ``images`` left to compute on the workers of ``view``."""
        running = None if view.running is None else _work(view.running)
        with self._lock:
            prediction = self.predictor.predict(_work(view.ahead), tokens, images, view.decode_batch + 1, context,
                                                _work(view.looser), tier.rank, DECODE_RESERVE, running,
                                                view.running_elapsed_s, _work(view.recent), ARRIVAL_WINDOW_S,
                                                view.prefill, view.decode)
            makes_late = self._makes_late(view, tokens, images) if view.promises else None
        idle = view.ahead.requests == 0 and view.decode_batch == 0 and view.in_flight == 0
        return dataclasses.replace(prediction, idle=idle, decode_tightest_rank=view.decode_tightest_rank,
                                   makes_late=makes_late)

    def _makes_late(self, view: LoadView, tokens: int, images: int) -> LateRequest | None:
        """The queued request of ``view.promises`` that a new request of ``tokens`` tokens and ``images`` images, served before it, would make
        late, the one it would make latest; None: none. A promise is kept for the tiers that are
        refused for latency, to its tier's TTFT SLO times that tier's attainment-feedback factor,
        and only while its prediction is on time (refusing for one already late saves nothing).
        Call under the lock."""
        now, scale = time.monotonic(), self.predictor.prefill_scale(view.prefill)
        running = view.running if view.running is not None else PrefillWork()
        before = self.predictor.remaining_seconds(_work(running), view.running_elapsed_s, scale)
        extra = scale * self.predictor.prefill_seconds(tokens, images)
        worst: LateRequest | None = None
        for promise in view.promises:
            due = self._due_in(promise, now)
            if due is None:
                continue
            first = self.predictor.first_token_in(_work(promise.through), before, promise.rank, scale)
            late = first + extra * self.predictor.ttft_corrections[promise.rank].value
            if first <= due < late and (worst is None or late - due > worst.late_by_s):
                worst = LateRequest(promise.rank, late, due)
        return worst

    def _due_in(self, promise: Promise, now: float) -> float | None:
        """Seconds from ``now`` until the first token of ``promise`` is due (None: its tier is never
        refused for latency, so nothing is promised to it). Call under the lock."""
        name = TIERS[min(max(promise.rank, 0), len(TIERS) - 1)]
        if name == NEVER_REFUSED:
            return None
        factor = self._limit_factor_locked(promise.rank, "ttft")
        return promise.arrived_at + tier_slo(name, self.config.slo).ttft_ms / 1000.0 * factor - now

    def admit(self, client: EngineClient, tier: Tier, tokens: int, images: int, max_tokens: int,
              inputs: ProcessedInputs | None = None, waited_s: float = 0.0, refuse: bool = True) -> Prediction | None:
        """Predict, and refuse a request whose prediction exceeds its tier's SLO × (1 + margin),
        that would push running requests of a tighter tier on its decode worker past their TPOT SLO,
        or that, prefilled before queued requests of a looser tier, would make one of them late
        (``admission.protect_admitted``).

        ``waited_s``, the seconds since the call arrived (decoding its images, the dispatch hold, a
        front end too busy to get to it), is part of its TTFT: it is added to the prediction.
        ``refuse=False``: predict only (a call already admitted at its decision deadline).

        Raises:
            Rejection: 429 ``ttft_slo`` or ``tpot_slo``; the message names the SLO, the prediction and
                the excess; ``Retry-After`` is the TTFT excess in seconds (1 s for TPOT; for a queued
                request it would make late, the time until that one is due), at least a second.
        """
        self.note_call(tier)
        prediction = _waited(self.predict(client, tier, tokens, images, max_tokens, inputs), waited_s)
        if prediction is None or not refuse or not self.config.admission.predict or tier.name == NEVER_REFUSED:
            return prediction
        if prediction.idle:  # alone, refusing protects no one; and an idle service must keep learning
            return prediction
        refused = self._ttft_refusal(tier, prediction) or self._promise_refusal(tier, prediction)
        if refused is not None:
            raise Rejection(429, "ttft_slo", *refused)
        why = self._tpot_refusal(tier, prediction, max_tokens)
        if why is not None:
            raise Rejection(429, "tpot_slo", why, 1.0)
        return prediction

    def _ttft_refusal(self, tier: Tier, prediction: Prediction) -> tuple[str, float] | None:
        """(message, seconds over the SLO) when :meth:`admit`'s TTFT rules refuse ``prediction``,
        else None. Two rules: the prediction over the tier's TTFT SLO × (1 + ``admission.margin``);
        or its queue + prefill part, scaled by the spread of the tier's recent measured / predicted
        ratios at the tier's attainment target (:meth:`RatioCorrection.spread`: 1.9× for the 90th
        percentile in a typical llava run here), plus the overhead, over the SLO itself: a
        prediction that is right on the median would still leave more than the target's share of
        admitted requests late."""
        margin, slo = self.config.admission.margin, tier.slo.ttft_ms / 1000.0
        factor = self.limit_factor(tier.rank, "ttft")
        if prediction.ttft_s > slo * (1 + margin) * factor:
            return _message("TTFT", tier, prediction.ttft_s, slo, margin, factor), prediction.ttft_s - slo
        with self._lock:
            spread = self.predictor.ttft_corrections[prediction.rank].spread(max(0.5, tier.slo.attainment))
            overhead = self.predictor.overhead_s + self.predictor.transit_s
        fixed = overhead + prediction.waited_s  # not part of the queue + prefill the spread was measured on
        upper = (prediction.ttft_s - fixed) * spread + fixed
        if upper > slo * factor:
            return _spread_message(tier, prediction.ttft_s, upper, spread, slo, factor), upper - slo
        return None

    def _promise_refusal(self, tier: Tier, prediction: Prediction) -> tuple[str, float] | None:
        """(message, seconds until the request it would make late is due) when ``prediction``'s call,
        prefilled before a queued request of a looser tier, would make that one late
        (:attr:`Prediction.makes_late`) and ``admission.protect_admitted`` is on; else None."""
        if prediction.makes_late is None or not self.config.admission.protect_admitted:
            return None
        late = prediction.makes_late
        return _promise_message(tier, late, self.limit_factor(late.rank, "ttft")), late.due_in_s

    def _tpot_refusal(self, tier: Tier, prediction: Prediction, max_tokens: int) -> str | None:
        """Why :meth:`admit`'s TPOT rules refuse ``prediction`` (the message), else None: its own
        TPOT over its tier's SLO × (1 + margin), or a tighter tier's TPOT it would break."""
        margin, tpot_slo = self.config.admission.margin, tier.slo.tpot_ms / 1000.0
        factor = self.limit_factor(tier.rank, "tpot")
        if max_tokens > 1 and prediction.tpot_s > tpot_slo * (1 + margin) * factor:
            return _message("TPOT", tier, prediction.tpot_s, tpot_slo, margin, factor)
        return self._protect_excess(tier, prediction, max_tokens)

    def _protected(self, tier: Tier, prediction: Prediction) -> tuple[int, bool] | None:
        """(rank, live) of the tightest tier, tighter than ``tier``, whose TPOT a request joining the
        decode worker of ``prediction`` must not break: live there (``live``), or only sent
        lately (a call of it arrived within :data:`DEMAND_WINDOW_S`: room is kept for the next
        one, which a decode batch filled to a looser tier's limit would refuse); None: none."""
        now = time.monotonic()
        recent = next((rank for rank, at in enumerate(self._last_call)
                       if rank < tier.rank and at is not None and now - at <= DEMAND_WINDOW_S), None)
        live = prediction.decode_tightest_rank
        live = live if live is not None and live < tier.rank else None
        if live is None and recent is None:
            return None
        if recent is not None and (live is None or recent < live):
            return recent, False
        return live, True  # type: ignore[return-value]

    def _protect_excess(self, tier: Tier, prediction: Prediction, max_tokens: int) -> str | None:
        """Why a request of ``tier`` with ``prediction`` must not join its decode worker now: every
        request there gets the same step, and with it (and :data:`DECODE_RESERVE` more) the step
        would pass the TPOT SLO × (1 + margin) of a tighter tier there or sent lately (the
        message), else None. A one-token answer never decodes; a tier only sent lately whose
        SLO :data:`DECODE_RESERVE` requests alone would miss is not kept room for."""
        protected = self._protected(tier, prediction) if max_tokens > 1 else None
        if protected is None:
            return None
        name = TIERS[protected[0]]
        slo = tier_slo(name, self.config.slo).tpot_ms / 1000.0
        margin, factor = self.config.admission.margin, self.limit_factor(protected[0], "tpot")
        if prediction.tpot_reserved_s <= slo * (1 + margin) * factor:
            return None
        if not protected[1]:  # room kept for calls to come: only if their SLO can be met at all
            with self._lock:
                alone = self.predictor.decode.predict((1.0, DECODE_RESERVE, 0)) * self.predictor.tpot_correction.value
            if alone > slo * (1 + margin) * factor:
                return None
        return _protect_message(tier, name, protected[1], prediction.tpot_reserved_s, slo, margin, factor)

    def note_call(self, tier: Tier) -> None:
        """A call of ``tier`` arrived (admitted or not): its tier is in demand (:meth:`_protected`)."""
        self._last_call[min(max(tier.rank, 0), len(TIERS) - 1)] = time.monotonic()

    def holds(self, tier: Tier) -> bool:
        """Whether calls of ``tier`` wait for spare capacity before dispatch (:meth:`hold_reason`):
        the tier that is never refused, while prediction is on."""
        return self.config.admission.predict and tier.name == NEVER_REFUSED

    def hold_reason(self, client: EngineClient, tier: Tier, tokens: int, images: int, max_tokens: int,
                    inputs: ProcessedInputs | None = None) -> str | None:
        """Why a request of the never-refused tier should not be dispatched yet, or None to go now
        (it is queued instead of refused: :mod:`mm_serve.admission.dispatch_hold`). It waits while,
        on the workers the router would pick now,

        * requests of a tighter tier are queued or prefilling on its prefill worker (they go first,
          and a batch of its prefill in progress would delay the ones that arrive during it);
        * a full prefill batch (``scheduler.prefill_batch_size`` requests) of its own or a looser
          tier is already queued there (what it would add is work no tighter request may wait for);
        * a tighter tier runs on its decode worker, or was sent lately, and the predicted decode
          step with it exceeds that tier's TPOT SLO × (1 + ``admission.margin``), as in :meth:`admit`.

        None as well when a role has no ready worker (the engine client then waits for one).
        """
        rank = tier.rank
        if rank == 0:
            return None
        view = client.load_view(rank - 1, tokens, max_tokens) if inputs is None else \
            client.load_view(rank - 1, tokens, max_tokens, inputs)
        if view is None:
            return None
        if view.ahead.requests > 0:
            return f"{view.ahead.requests} tighter request(s) queued on prefill worker {view.prefill}"
        if view.looser.requests >= self.config.scheduler.prefill_batch_size:
            return f"a prefill batch of looser requests already queued on prefill worker {view.prefill}"
        if max_tokens > 1:
            return self._protect_excess(tier, self._predict_in(view, tier, tokens, images), max_tokens)
        return None

    def report(self) -> dict[str, object]:
        """The predictor's coefficients, corrections and their age (for /health), read under the lock
        (reading a fit may re-solve it)."""
        with self._lock:
            return self.predictor.report()

    def precheck(self, client: EngineClient, tier: Tier, max_tokens: int, tokens: int = 1, images: int = 0,
                 waited_s: float = 0.0) -> None:
        """Refuse, before the call's images are fetched and decoded (cheap refusals under
        overload), what the TTFT rules of :meth:`admit` (its own TTFT, the queued looser requests
        it would make late) rule out whatever else the call holds:
        the prediction for a prompt of ``tokens`` tokens and ``images`` images (the work it is
        certain to bring: images no cache can hold, :mod:`mm_serve.admission.seen_images`) on
        *each* ready prefill worker is refused by the TTFT rules of :meth:`admit`. The rest of its prompt only adds to a
        prediction and the router picks one of those workers, so such a call would be refused
        after its images too. The TPOT rules of :meth:`admit` are checked the same way, on the
        decode worker the router would pick for each (a longer prompt only adds context, so only
        to the step); with several decode workers, the one picked later for the whole prompt may
        differ when the first lacks room for it.

        Raises:
            Rejection: 429 ``ttft_slo`` or ``tpot_slo``, as :meth:`admit`.
        """
        self.note_call(tier)
        if not self.config.admission.predict or tier.name == NEVER_REFUSED:
            return
        tokens = max(1, tokens)
        views = client.load_views(tier.rank, tokens, max_tokens)
        best: tuple[Prediction, tuple[str, float]] | None = None
        tpot_refusal: str | None = None
        for view in views:  # no cache believed (the views carry no page hashes)
            prediction = _waited(self._predict_in(view, tier, tokens, images), waited_s)
            if prediction.idle:
                return  # admit() never refuses it
            refused = self._ttft_refusal(tier, prediction) or self._promise_refusal(tier, prediction)
            if refused is not None:
                best = (prediction, refused) if best is None or prediction.ttft_s < best[0].ttft_s else best
                continue
            tpot_refusal = self._tpot_refusal(tier, prediction, max_tokens)
            if tpot_refusal is None:
                return  # this worker could still make it
        if tpot_refusal is not None:
            raise Rejection(429, "tpot_slo", tpot_refusal, 1.0)
        if best is not None:
            raise Rejection(429, "ttft_slo", *best[1])

    def on_step(self, role: str, index: int, step: messages.StepTiming) -> None:
        """Refit from one timed step of worker ``index`` of ``role`` (the engine client's step listener)."""
        with self._lock:
            if step.kind == "prefill":
                self.predictor.observe_prefill(step.tokens, step.images, step.seconds, index, step.cpu_seconds)
            elif step.kind == "decode":
                self.predictor.observe_decode(step.requests, step.tokens, step.seconds, index)

    def on_finished(self, state: RequestState) -> None:
        """Refit the front-end overhead and the corrections from a finished request that was
        prefilled (its lifetime events say so) against its prediction: the measured span from its
        dispatch to its first token here (the queue and batch in progress ahead of it, its own
        batch, the messages both ways: what the prediction's queue + prefill part stands for), the
        overhead from its TTFT less that span and the wait before its prediction, and its TPOT.
        A request delayed by a worker fault (moved to a new attempt, or parked while a role had no
        ready worker: ``RequestState.delayed_by_fault``) teaches nothing: its latency measures the
        restart, and learning it (a fresh-user test: TTFT corrections at their 10x bound and the
        attainment feedback at 0.5 after a prefill worker was killed under a burst) refused most
        interactive calls to the recovered, idle service for seconds."""
        if state.delayed_by_fault:
            return
        self._feed_back(state)
        if state.first_token_time is None or LifetimeEvent.PREFILL_END.value not in state.events:
            return
        ttft, span = state.first_token_time - state.arrival_time, state.first_token_time - state.submitted_at
        times = state.token_times
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) >= 3 and state.error is None else None
        if state.prediction is None:  # a call's other requests (and calls with no worker ready at admission):
            return  # their wait in the dispatch hold is not known here, and one request per call is enough
        with self._lock:
            self.predictor.observe_overhead(ttft - span - state.prediction.waited_s)
            self.predictor.observe_finished(state.prediction, span, tpot)

    def _feed_back(self, state: RequestState) -> None:
        """The attainment feedback's observation of one served request of a tier that can be
        refused: late or in time on its tier's TTFT SLO, and on its TPOT SLO, each × (1 +
        ``admission.margin``) when the margin is negative. The server measures from the call's
        arrival to the token's receipt here; the client also lives through its connection, the
        server's parsing and the stream's delivery, which the margin's headroom is for (on the
        llava admission benchmark at 4x the goodput, interactive requests the server saw in time
        were late for the client 1 in 10 times, mostly on TPOT)."""
        served = state.served_latency()
        if served is None or state.tier is None or state.tier == NEVER_REFUSED:
            return
        rank = TIERS.index(state.tier)
        slo, bound = tier_slo(state.tier, self.config.slo), min(1.0, 1.0 + self.config.admission.margin)
        with self._lock:
            self.feedback[(rank, "ttft")].observe(served[0] > bound * slo.ttft_ms / 1000.0)
            self.feedback[(rank, "tpot")].observe(served[1] > bound * slo.tpot_ms / 1000.0)

    def feedback_report(self) -> dict[str, dict[str, object]]:
        """Per tier that can be refused: each SLO's limit factor as applied (:meth:`limit_factor`: 1.0
        with the feedback or prediction off), and the late and in-time requests seen (for /health)."""
        applied = self._feedback_applied
        with self._lock:
            return {name: {slo: {"factor": round(self.feedback[(rank, slo)].value if applied else 1.0, 4),
                                 "late": self.feedback[(rank, slo)].late,
                                 "in_time": self.feedback[(rank, slo)].in_time} for slo in FEEDBACK_SLOS}
                    for rank, name in enumerate(TIERS) if name != NEVER_REFUSED}


P = TypeVar("P", Prediction, Prediction | None)


def _work(work: PrefillWork) -> QueueAhead:
    """The router's count of prefill work as the predictor takes it."""
    return QueueAhead(work.requests, work.tokens, work.images)


def _waited(prediction: P, waited_s: float) -> P:
    """``prediction`` with the ``waited_s`` seconds since its call arrived added to its TTFT."""
    if prediction is None or waited_s <= 0:
        return prediction
    return dataclasses.replace(prediction, ttft_s=prediction.ttft_s + waited_s, waited_s=waited_s)


def _amount(seconds: float) -> str:
    """An excess in words: ``0.0004`` -> "under 1 ms", ``0.0123`` -> "12 ms", ``1.5`` -> "1.500 s"."""
    ms = round(1000 * seconds)
    if ms >= 1000:
        return f"{seconds:.3f} s"
    return "under 1 ms" if ms < 1 else f"{ms} ms"


def _limit(margin: float, factor: float = 1.0) -> str:
    """How the refusal threshold relates to the SLO, in words (``factor``: the attainment feedback's)."""
    if factor < 1:
        return (f"admission refuses above {100 * (1 + margin) * factor:.0f} % of the SLO: admission.margin {margin:g}, "
                f"tightened x{factor:.2f} while the tier's requests have been missing it more than its attainment "
                f"target allows")
    if margin < 0:
        return f"admission refuses above {100 * (1 + margin):.0f} % of the SLO, admission.margin {margin:g}"
    return f"admission refuses above the SLO + {100 * margin:.0f} %, admission.margin {margin:g}"


def _protect_message(tier: Tier, tighter: str, live: bool, predicted: float, slo: float, margin: float,
                     factor: float) -> str:
    serving = f"serving {tighter} requests" if live else f"keeping room for {tighter} requests"
    return (f"the service is overloaded for the {tier.name} tier: its decode worker is {serving}, "
            f"whose TPOT SLO is {slo:.3f} s, and with this request the predicted TPOT is {predicted:.3f} s "
            f"({_limit(margin, factor)}); retry later, or send service_tier 'flex' (batch tier, never refused for "
            f"latency)")


def _promise_message(tier: Tier, late: LateRequest, factor: float = 1.0) -> str:
    """The 429 message of a call refused to keep ``late``, a queued request of a looser tier, on time
    (``factor``: the attainment feedback's on that tier's TTFT limit)."""
    looser = TIERS[min(max(late.rank, 0), len(TIERS) - 1)]
    limit = "" if factor >= 1 else (f" x {factor:.2f}, tightened while the {looser} tier's requests miss its "
                                    f"attainment target,")
    return (f"the service is overloaded for the {tier.name} tier: this request would be prefilled before a queued "
            f"{looser} tier request admitted earlier and delay its first token to {late.first_token_in_s:.3f} s from now, past its "
            f"TTFT SLO{limit} ({late.due_in_s:.3f} s from now) by {_amount(late.late_by_s)}; retry later, or send "
            f"service_tier 'flex' (batch tier, never refused for latency)")


def _spread_message(tier: Tier, predicted: float, upper: float, spread: float, slo: float, factor: float) -> str:
    percent = round(100 * tier.slo.attainment)
    limit = "" if factor >= 1 else f" x {factor:.2f} (tightened while the tier's requests miss its attainment target)"
    return (f"the service is overloaded for the {tier.name} tier: the predicted TTFT is {predicted:.3f} s, and with "
            f"the spread of recent measurements around predictions ({spread:.2f}x at the {percent}th percentile, "
            f"its attainment target) {upper:.3f} s, over its TTFT SLO of {slo:.3f} s{limit} by {_amount(upper - slo * factor)}; "
            f"retry later, or send service_tier 'flex' (batch tier, never refused for latency)")


def _message(what: str, tier: Tier, predicted: float, slo: float, margin: float, factor: float) -> str:
    excess = predicted - slo
    relation = (f"over its {what} SLO of {slo:.3f} s by {_amount(excess)} ({100 * excess / slo:.0f} %" if excess > 0
                else f"{-100 * excess / slo:.0f} % under its {what} SLO of {slo:.3f} s (")
    sep = "; " if excess > 0 else ""
    return (f"the service is overloaded for the {tier.name} tier: the predicted {what} is {predicted:.3f} s, "
            f"{relation}{sep}{_limit(margin, factor)}); retry later, or send service_tier 'flex' (batch tier, never "
            f"refused for latency)")
