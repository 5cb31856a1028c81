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
(:meth:`AdmissionController._protect_excess`). The ``batch`` tier is never refused for latency
(only the hard bounds apply to it; it waits in the dispatch hold instead,
:meth:`AdmissionController.hold_reason`), nor is anything with ``admission.predict`` false. The
predictor learns from every timed worker step and every finished request
(:class:`~mm_serve.admission.learning.AdmissionLearning`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TypeVar

from mm_serve.admission import refusal_text
from mm_serve.admission.learning import AdmissionLearning
from mm_serve.admission.load_source import LoadSource
from mm_serve.admission.predictor import LateRequest, Prediction, QueueAhead
from mm_serve.admission.rejection import Rejection
from mm_serve.config import ServiceConfig
from mm_serve.engine.load_view import ARRIVAL_WINDOW_S, LoadView, PrefillWork, Promise
from mm_serve.ground.tiers import NEVER_REFUSED, Tier
from mm_serve.inputs.input_processor import ProcessedInputs

DEMAND_WINDOW_S = 5.0  # a tier whose last call came this recently keeps its room on the decode workers
DECODE_RESERVE = 2  # requests of a tighter tier the decode step is kept room for (see _protect_excess)


class AdmissionController(AdmissionLearning):
    """The predictor and the admission rule of one service (one per API app).

    Raises (constructor):
        ProfileError: ``admission.profile`` cannot be read or is not a valid profile.
    """

    def __init__(self, config: ServiceConfig) -> None:
        super().__init__(config)
        self._last_call: list[float | None] = [None] * len(Tier)  # monotonic time of each tier's last call

    def predict(self, load: LoadSource, tier: Tier, tokens: int, images: int, max_tokens: int,
                inputs: ProcessedInputs | None = None) -> Prediction | None:
        """The prediction for one request of ``tokens`` prompt tokens and ``images`` tower passes (its
        images, a tiled image counting each tile: :attr:`ProcessedInputs.num_tiles`) in ``tier``; None
        while a role has no ready worker (the request then waits for one, bounded by ``api.timeout_ms``). With its
        ``inputs``, the tokens and images the chosen prefill worker is believed to hold in its
        prefix cache are not counted in its own prefill."""
        view = load.load_view(tier, tokens, max_tokens) if inputs is None else \
            load.load_view(tier, tokens, max_tokens, inputs)
        return None if view is None else self._predict_in(view, tier, tokens, images)

    def _predict_in(self, view: LoadView, tier: Tier, tokens: int, images: int) -> Prediction:
        """The prediction for a prompt of ``tokens`` tokens and ``images`` images on the workers of
        ``view``: its cached part (as the view believes) left out of its prefill, the decode context
        that worker's pages in use plus the prompt."""
        context = view.decode_pages_used * self.config.kv_cache.page_size + tokens
        tokens, images = tokens - view.cached_tokens, images - view.cached_images
        running = None if view.running is None else _work(view.running)
        with self.lock:
            prediction = self.predictor.predict(_work(view.ahead), tokens, images, view.decode_batch + 1, context,
                                                _work(view.looser), tier, DECODE_RESERVE, running,
                                                view.running_elapsed_s, _work(view.recent), ARRIVAL_WINDOW_S,
                                                view.prefill, view.decode, view.decode_tightest)
            makes_late = self._makes_late(view, tokens, images) if view.promises else None
        idle = view.ahead.requests == 0 and view.decode_batch == 0 and view.in_flight == 0
        return dataclasses.replace(prediction, idle=idle, decode_tightest=view.decode_tightest,
                                   makes_late=makes_late)

    def _makes_late(self, view: LoadView, tokens: int, images: int) -> LateRequest | None:
        """The queued request of ``view.promises`` that a new request of ``tokens`` tokens and
        ``images`` images, served before it, would make late, the one it would make latest; None:
        none. A promise is kept for the tiers that are refused for latency, to its tier's TTFT SLO
        times that tier's attainment-feedback factor, and only while its prediction is on time
        (refusing for one already late saves nothing). Call under the lock."""
        now, scale = time.monotonic(), self.predictor.prefill_scale(view.prefill)
        running = view.running if view.running is not None else PrefillWork()
        before = self.predictor.remaining_seconds(_work(running), view.running_elapsed_s, scale)
        extra = scale * self.predictor.prefill_seconds(tokens, images)
        worst: LateRequest | None = None
        for promise in view.promises:
            due = self._due_in(promise, now)
            if due is None:
                continue
            first = self.predictor.first_token_in(_work(promise.through), before, promise.tier, scale)
            late = first + extra * self.predictor.ttft_corrections[promise.tier].value
            if first <= due < late and (worst is None or late - due > worst.late_by_s):
                worst = LateRequest(promise.tier, late, due)
        return worst

    def _due_in(self, promise: Promise, now: float) -> float | None:
        """Seconds from ``now`` until the first token of ``promise`` is due (None: its tier is never
        refused for latency, so nothing is promised to it). Call under the lock."""
        if promise.tier == NEVER_REFUSED:
            return None
        factor = self.feedback.factor(promise.tier, "ttft")
        return promise.arrived_at + self.config.slo.of(promise.tier).ttft_s * factor - now

    def admit(self, load: LoadSource, tier: Tier, tokens: int, images: int, max_tokens: int,
              inputs: ProcessedInputs | None = None, waited_s: float = 0.0, refuse: bool = True,
              grammar_s: float = 0.0) -> Prediction | None:
        """Predict, and refuse a request whose prediction exceeds its tier's SLO × (1 + margin),
        that would push running requests of a tighter tier on its decode worker past their TPOT SLO,
        or that, prefilled before queued requests of a looser tier, would make one of them late
        (``admission.protect_admitted``).

        ``waited_s``, the seconds since the call arrived (decoding its images, the dispatch hold, a
        front end too busy to get to it), is part of its TTFT: it is added to the prediction.
        ``refuse=False``: predict only (a call already admitted at its decision deadline).
        ``grammar_s``, what compiling its structured-output grammar took the front end (the prefill
        worker compiles it again before it samples the first token; ~0 once cached), is added too.

        Raises:
            Rejection: 429 ``ttft_slo`` or ``tpot_slo``; the message names the SLO, the prediction and
                the excess; ``Retry-After`` is the TTFT excess in seconds (1 s for TPOT; for a queued
                request it would make late, the time until that one is due), at least a second.
        """
        self.note_call(tier)
        prediction = _waited(self.predict(load, tier, tokens, images, max_tokens, inputs), waited_s, grammar_s)
        if prediction is None or not refuse or not self.config.admission.predict or tier == NEVER_REFUSED:
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
        target = self.config.slo.of(tier)
        margin, slo = self.config.admission.margin, target.ttft_s
        factor = self.limit_factor(tier, "ttft")
        if prediction.ttft_s > slo * (1 + margin) * factor:
            return (refusal_text.over_slo("TTFT", tier, prediction.ttft_s, slo, margin, factor),
                    prediction.ttft_s - slo)
        with self.lock:
            spread = self.predictor.ttft_corrections[prediction.tier].spread(max(0.5, target.attainment))
            overhead = self.predictor.overhead_s + self.predictor.transit_s
        fixed = overhead + prediction.waited_s  # not part of the queue + prefill the spread was measured on
        upper = (prediction.ttft_s - fixed) * spread + fixed
        if upper > slo * factor:
            return (refusal_text.over_spread(tier, target.attainment, prediction.ttft_s, upper, spread, slo, factor),
                    upper - slo)
        return None

    def _promise_refusal(self, tier: Tier, prediction: Prediction) -> tuple[str, float] | None:
        """(message, seconds until the request it would make late is due) when ``prediction``'s call,
        prefilled before a queued request of a looser tier, would make that one late
        (:attr:`Prediction.makes_late`) and ``admission.protect_admitted`` is on; else None."""
        if prediction.makes_late is None or not self.config.admission.protect_admitted:
            return None
        late = prediction.makes_late
        return refusal_text.makes_late(tier, late, self.limit_factor(late.tier, "ttft")), late.due_in_s

    def _tpot_refusal(self, tier: Tier, prediction: Prediction, max_tokens: int) -> str | None:
        """Why :meth:`admit`'s TPOT rules refuse ``prediction`` (the message), else None: its own
        TPOT over its tier's SLO × (1 + margin), or a tighter tier's TPOT it would break."""
        margin, tpot_slo = self.config.admission.margin, self.config.slo.of(tier).tpot_s
        factor = self.limit_factor(tier, "tpot")
        # the work of its steps: a paced interval is below the SLO by construction and refusing does not shorten it
        if max_tokens > 1 and prediction.tpot_judged_s > tpot_slo * (1 + margin) * factor:
            return refusal_text.over_slo("TPOT", tier, prediction.tpot_judged_s, tpot_slo, margin, factor)
        return self._protect_excess(tier, prediction, max_tokens)

    def _protected(self, tier: Tier, prediction: Prediction) -> tuple[Tier, bool] | None:
        """(tier, live) of the tightest tier, tighter than ``tier``, whose TPOT a request joining the
        decode worker of ``prediction`` must not break: live there (``live``), or only sent
        lately (a call of it arrived within :data:`DEMAND_WINDOW_S`: room is kept for the next
        one, which a decode batch filled to a looser tier's limit would refuse); None: none."""
        now = time.monotonic()
        recent = next((Tier(rank) for rank, at in enumerate(self._last_call)
                       if rank < tier and at is not None and now - at <= DEMAND_WINDOW_S), None)
        live = prediction.decode_tightest
        live = live if live is not None and live < tier else None
        if live is None and recent is None:
            return None
        if recent is not None and (live is None or recent < live):
            return recent, False
        assert live is not None
        return live, True

    def _protect_excess(self, tier: Tier, prediction: Prediction, max_tokens: int) -> str | None:
        """Why a request of ``tier`` with ``prediction`` must not join its decode worker now: every
        request there gets the same step, and with it (and :data:`DECODE_RESERVE` more) the step
        would pass the TPOT SLO × (1 + margin) of a tighter tier there or sent lately (the
        message), else None. A one-token answer never decodes; a tier only sent lately whose
        SLO :data:`DECODE_RESERVE` requests alone would miss is not kept room for."""
        protected = self._protected(tier, prediction) if max_tokens > 1 else None
        if protected is None:
            return None
        tighter, live = protected
        slo = self.config.slo.of(tighter).tpot_s
        margin, factor = self.config.admission.margin, self.limit_factor(tighter, "tpot")
        if prediction.tpot_reserved_s <= slo * (1 + margin) * factor:
            return None
        if not live:  # room kept for calls to come: only if their SLO can be met at all
            with self.lock:
                alone = self.predictor.decode.predict((1.0, DECODE_RESERVE, 0)) * self.predictor.tpot_correction.value
            if alone > slo * (1 + margin):  # the feedback's factor says how loaded, not whether it can be met
                return None
        return refusal_text.breaks_tighter(tier, tighter, live, prediction.tpot_reserved_s, slo, margin, factor)

    def note_call(self, tier: Tier) -> None:
        """A call of ``tier`` arrived (admitted or not): its tier is in demand (:meth:`_protected`)."""
        self._last_call[tier] = time.monotonic()

    def holds(self, tier: Tier) -> bool:
        """Whether calls of ``tier`` wait for spare capacity before dispatch (:meth:`hold_reason`):
        the tier that is never refused, while prediction is on."""
        return self.config.admission.predict and tier == NEVER_REFUSED

    def hold_reason(self, load: LoadSource, tier: Tier, tokens: int, images: int, max_tokens: int,
                    inputs: ProcessedInputs | None = None) -> str | None:
        """Why a request of the never-refused tier should not be dispatched yet, or None to go now
        (it is queued instead of refused: :mod:`mm_serve.admission.dispatch_hold`). It waits while,
        on the workers the router would pick now,

        * requests of a tighter tier are queued or prefilling on its prefill worker (they go first,
          and a batch of its prefill in progress would delay the ones that arrive during it);
        * a full prefill batch (``scheduler.prefill_batch_size`` requests) of its own or a looser
          tier is already queued there (what it would add is work no tighter request may wait for);
        * a tighter tier runs on its decode worker, or was sent lately, and the predicted decode
          step with it exceeds that tier's TPOT SLO × (1 + ``admission.margin``), as in :meth:`admit`;
        * a tighter tier decodes on its decode worker while a tighter tier sent lately is missing its
          attainment aim (its attainment feedback's TTFT or TPOT factor is below 1): what is measured
          wins over what is predicted, and work that is promised nothing but its own SLO is not added
          while the tighter tiers are late (the factors drift back to 1 over minutes once the load is
          gone: with no tighter request running, they do not hold it).

        None as well when a role has no ready worker (the engine client then waits for one).
        """
        if tier == Tier.INTERACTIVE:
            return None
        tighter = Tier(tier - 1)
        view = load.load_view(tighter, tokens, max_tokens) if inputs is None else \
            load.load_view(tighter, tokens, max_tokens, inputs)
        if view is None:
            return None
        if view.ahead.requests > 0:
            return f"{view.ahead.requests} tighter request(s) queued on prefill worker {view.prefill}"
        if view.looser.requests >= self.config.scheduler.prefill_batch_size:
            return f"a prefill batch of looser requests already queued on prefill worker {view.prefill}"
        prediction = self._predict_in(view, tier, tokens, images)
        live = prediction.decode_tightest
        if live is not None and live < tier:
            missing = self._missing_tighter(tier)
            if missing is not None:
                return missing
        return self._protect_excess(tier, prediction, max_tokens) if max_tokens > 1 else None

    def _missing_tighter(self, tier: Tier) -> str | None:
        """Why a request of ``tier`` waits for a tighter tier sent lately (within :data:`DEMAND_WINDOW_S`)
        whose requests are missing their attainment aim (a feedback factor below 1), else None."""
        now = time.monotonic()
        for rank in range(tier):
            at = self._last_call[rank]
            if at is None or now - at > DEMAND_WINDOW_S:
                continue
            tighter = Tier(rank)
            for slo in ("ttft", "tpot"):
                factor = self.limit_factor(tighter, slo)
                if factor < 1.0:
                    return (f"{tighter.label} requests have been missing their {slo.upper()} SLO "
                            f"(attainment feedback x{factor:.2f})")
        return None

    def precheck(self, load: LoadSource, tier: Tier, max_tokens: int, tokens: int = 1, images: int = 0,
                 waited_s: float = 0.0) -> None:
        """Refuse, before the call's images are fetched and decoded (cheap refusals under
        overload), what the rules of :meth:`admit` rule out whatever else the call holds: the
        prediction for a prompt of ``tokens`` tokens and ``images`` images (the work it is
        certain to bring: images no cache can hold, :mod:`mm_serve.admission.seen_images`) on
        *each* ready prefill worker is refused by the TTFT rules of :meth:`admit`. The rest of its
        prompt only adds to a prediction and the router picks one of those workers, so such a
        call would be refused after its images too. The TPOT rules are checked the same way, on
        the decode worker the router would pick for each (a longer prompt only adds context, so
        only to the step); with several decode workers, the one picked later for the whole prompt
        may differ when the first lacks room for it.

        Raises:
            Rejection: 429 ``ttft_slo`` or ``tpot_slo``, as :meth:`admit`.
        """
        self.note_call(tier)
        if not self.config.admission.predict or tier == NEVER_REFUSED:
            return
        tokens = max(1, tokens)
        best: tuple[Prediction, tuple[str, float]] | None = None
        tpot_refusal: str | None = None
        for view in load.load_views(tier, tokens, max_tokens):  # no cache believed (no page hashes)
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


def _work(work: PrefillWork) -> QueueAhead:
    """The ledger's count of prefill work as the predictor takes it."""
    return QueueAhead(work.requests, work.tokens, work.images)


P = TypeVar("P", Prediction, Prediction | None)


def _waited(prediction: P, waited_s: float, grammar_s: float = 0.0) -> P:
    """``prediction`` with the ``waited_s`` seconds since its call arrived and the ``grammar_s`` its
    grammar's compile will take added to its TTFT."""
    waited_s, grammar_s = max(0.0, waited_s), max(0.0, grammar_s)
    if prediction is None or waited_s + grammar_s == 0:
        return prediction
    return dataclasses.replace(prediction, ttft_s=prediction.ttft_s + waited_s + grammar_s, waited_s=waited_s,
                               grammar_s=grammar_s)
