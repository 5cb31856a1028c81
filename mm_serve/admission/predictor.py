"""TTFT and TPOT prediction of a new request from the queues ahead of it, fitted online.

Three affine models (the planner's latency model in miniature, :mod:`mm_serve.planner.latency_model`):

* **prefill batch**: ``seconds = c + a·tokens + b·images`` (image tokens count in ``tokens``;
  ``b`` is the vision tower per image), refitted from each prefill step the workers report;
* **decode step**: ``seconds = c + a·batch + b·context_tokens``, refitted from each decode step;
* **overhead**: the front end's share of TTFT before dispatch, an average of measured TTFT
  minus the span from dispatch to first token; and a **transit**: that span less its own
  prefill for requests that waited for nothing (messages, the worker's wake-up), added to
  every prediction unscaled.

Predicted TTFT, on the chosen prefill worker = the rest of the batch prefilling there now
(workers report each batch's start) + the full batches of the work queued there at the
request's tier and tighter ones + its own batch (the rest of that work, itself, and the
looser work and new arrivals that fill it: :meth:`LatencyPredictor.through_own_batch`),
each priced by the prefill fit times that worker's speed factor (measured / the fit's
seconds of its batches) + overhead. Without batch reports (the colocated worker): the work
queued or prefilling at its tier and tighter ones, half a batch of looser work, its own
prefill, + overhead. The first token comes from the prefill worker, so
the KV hand-off is not on the TTFT path here: it delays the second token (ITL), which
the TPOT over the whole output absorbs. Predicted TPOT = one decode step at the chosen
decode worker's batch (its running and dispatched requests plus this one) and context, times
how much longer than the fit's price that worker's last steps took (:meth:`LatencyPredictor.decode_scale`);
with decode pacing (``scheduler.decode_step_interval_ms``, or ``decode_step_pacing`` by the tightest
tier there, the new request's included: :func:`mm_serve.runtime.pacing.paced_interval_s`) at least
that interval. Decode workers report their steps without the pacing sleep, so the fit keeps learning
the work, and the SLO rules judge the work alone (``Prediction.tpot_judged_s``): the interval is below
every running request's TPOT SLO by construction, and refusing a request would not shorten it.

Defaults fit the embedded model on a CPU core, or :meth:`LatencyPredictor.warm_start` fits
them to an ``mm-serve profile`` file (``admission.profile``); the fits move to the
measured times within a few dozen steps (about a minute of light traffic).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from mm_serve.admission.online_fit import OnlineLinearFit
from mm_serve.admission.ratio_correction import RatioCorrection
from mm_serve.ground.tiers import Tier
from mm_serve.planner.profile_file import Profile
from mm_serve.runtime.pacing import paced_interval_s

DEFAULT_PREFILL = (0.004, 2e-5, 0.004)  # s per batch, s per token, s per image
DEFAULT_DECODE = (0.004, 2e-4, 2e-7)  # s per step, s per running request, s per context token
DEFAULT_OVERHEAD_S = 0.003
DECODE_FORGETTING = 0.99  # decode steps come 10-100x as often as prefill batches: a longer memory
OVERHEAD_WEIGHT = 0.1  # weight of a new TTFT residual in the overhead average
TRANSIT_WEIGHT = 0.1  # weight of a new idle request's span less its prefill in the transit average
# a decode worker's steps against the fit's price for them just before each is learned: weight of a
# new step (about the last 10 steps count), and half-life in seconds once a second has passed without one
DECODE_LIVE_WEIGHT = 0.1
DECODE_LIVE_HALF_LIFE_S = 2.0


@dataclass(frozen=True)
class QueueAhead:
    """Work ahead of a new request on its prefill worker (its tier and tighter)."""

    requests: int
    tokens: int
    images: int


@dataclass(frozen=True)
class LateRequest:
    """A queued request of a looser tier that a new request, prefilled before it, would make late
    (:attr:`Prediction.makes_late`); seconds are from the moment of the prediction."""

    tier: Tier  # its tier
    first_token_in_s: float  # when its first token would come, the new request served first
    due_in_s: float  # when its first token is due: its TTFT SLO (times its tier's feedback factor) after its arrival

    @property
    def late_by_s(self) -> float:
        """Seconds past its due time its first token would come."""
        return self.first_token_in_s - self.due_in_s


@dataclass(frozen=True)
class Prediction:
    """Predicted seconds for one request."""

    ttft_s: float
    tpot_s: float
    queue_s: float  # TTFT base less its own prefill alone: the wait for the work ahead and its batch-mates (before the correction)
    ttft_base_s: float = 0.0  # queue + own prefill as the fit prices them (before the correction)
    tpot_step_s: float = 0.0  # one decode step (period) as the fit prices it, times the worker's last steps' scale, at least the paced interval (before the correction)
    tpot_work_s: float | None = None  # predicted TPOT without the pacing interval: the work of its steps (after the correction; None: tpot_s)
    tier: Tier = Tier.STANDARD  # the tier it was predicted for
    idle: bool = False  # nothing queued on its prefill worker and nothing running on its decode worker
    decode_tightest: Tier | None = None  # tightest tier live on its decode worker (None: none)
    waited_s: float = 0.0  # seconds from the call's arrival to this prediction (images, hold, a busy front end; in ``ttft_s``)
    grammar_s: float = 0.0  # seconds its prefill worker will spend compiling its grammar before the first token (in ``ttft_s``)
    tpot_reserved_s: float = 0.0  # predicted TPOT with ``reserve`` more requests of the same context on that worker (the work, as tpot_work_s)
    # the queued looser request that this one, served before it, would make miss its TTFT SLO (the worst; None: none)
    makes_late: LateRequest | None = None
    # what the fits priced then, to learn the corrections against the fits as they are when it finishes
    # (LatencyPredictor.repriced): its own prefill work (prompt tokens, images) and the prefill fit's
    # seconds for it; its decode batch (requests, context tokens), the decode fit's seconds for one step
    # of it, its decode worker's scale (LatencyPredictor.decode_scale) and the paced interval that step
    # lasts at least (0.0: unpaced)
    own_work: tuple[int, int] = (0, 0)
    own_fit_s: float = 0.0
    decode_work: tuple[int, int] = (0, 0)
    decode_fit_s: float = 0.0
    decode_live: float = 1.0
    paced_s: float = 0.0

    @property
    def tpot_judged_s(self) -> float:
        """The TPOT the SLO rules judge (seconds): the work of its steps, without a pacing interval."""
        return self.tpot_s if self.tpot_work_s is None else self.tpot_work_s


class LatencyPredictor:
    """The three fits and the prediction; observe methods are called from the receiver thread.

    ``decode_interval_s``, ``decode_pacing`` and ``tier_tpot_s`` are the decode workers' pacing
    (``scheduler.decode_step_interval_ms`` in seconds, 0 = none; ``scheduler.decode_step_pacing``, a
    fraction in [0, 1), 0 = none; the TPOT SLO of each tier in seconds, by rank): a paced step lasts
    at least that interval.
    """

    def __init__(self, prefill_batch_size: int, prefill_token_budget: int, decode_pacing: float = 0.0,
                 tier_tpot_s: Sequence[float] = (), decode_interval_s: float = 0.0) -> None:
        self.batch_size = max(1, prefill_batch_size)
        self.token_budget = max(1, prefill_token_budget)
        self.decode_interval_s, self.decode_pacing, self.tier_tpot_s = decode_interval_s, decode_pacing, tuple(tier_tpot_s)
        self.prefill = OnlineLinearFit(DEFAULT_PREFILL, (1.0, 1000.0, 1.0))
        # per prefill worker: its batches' measured / the shared fit's seconds (workers sharing a
        # core with others run slower; the fit learns the shape, these the speed of each)
        self.prefill_speed: dict[int, RatioCorrection] = {}
        self.decode = OnlineLinearFit(DEFAULT_DECODE, (1.0, 16.0, 4096.0), forgetting=DECODE_FORGETTING)
        # per decode worker: its last steps' measured / the fit's price for each, made before the fit
        # learned it (the fit follows about the last 100 steps and is pulled toward its start; a step
        # that doubles when a prefill burst takes half of a shared core shows here within a few steps)
        self.decode_live: dict[int, RatioCorrection] = {}
        self.overhead_s = DEFAULT_OVERHEAD_S
        # the messages from dispatch to first token and the worker's wake-up: a request that found
        # its prefill worker idle measures it as its span less its own prefill (additive: scaling it
        # with the corrections would make a small model's predictions explode under load)
        self.transit_s = 0.0
        # measured queue + prefill / the fit's, one per tier (interactive waits for looser batches in progress)
        self.ttft_corrections = [RatioCorrection() for _ in Tier]
        self.tpot_correction = RatioCorrection()  # measured TPOT / the fit's decode step
        self.started = time.monotonic()

    def prefill_seconds(self, tokens: float, images: float) -> float:
        """Predicted seconds of one prefill batch of ``tokens`` tokens and ``images`` images
        (expected counts may be fractional)."""
        return self.prefill.predict((1.0, tokens, images))

    def prefill_scale(self, worker: int | None) -> float:
        """How much slower than the shared fit prefill worker ``worker``'s batches run lately
        (1.0 for None or a worker not measured yet)."""
        speed = None if worker is None else self.prefill_speed.get(worker)
        return 1.0 if speed is None else speed.value

    def decode_scale(self, worker: int | None) -> float:
        """How much longer than the fit's price decode worker ``worker``'s last steps took (1.0 for
        None or a worker not measured yet)."""
        live = None if worker is None else self.decode_live.get(worker)
        return 1.0 if live is None else live.value

    def queue_seconds(self, ahead: QueueAhead) -> float:
        """Predicted seconds to prefill the work ``ahead`` (packed into full batches)."""
        if ahead.requests <= 0:
            return 0.0
        batches = max(math.ceil(ahead.requests / self.batch_size), math.ceil(ahead.tokens / self.token_budget))
        per_batch = self.prefill.coefficients[0]
        return max(0.0, self.prefill_seconds(ahead.tokens, ahead.images) + (batches - 1) * per_batch)

    def in_progress_seconds(self, looser: QueueAhead) -> float:
        """Expected rest of a batch of looser work that may be prefilling when the request arrives:
        a batch is not preempted, so it waits for it; half of one batch (at most the batch size
        and token budget) of the looser work queued there, on average."""
        if looser.requests <= 0:
            return 0.0
        share = min(1.0, self.batch_size / looser.requests, self.token_budget / max(1, looser.tokens))
        return 0.5 * self.prefill_seconds(round(share * looser.tokens), round(share * looser.images))

    def remaining_seconds(self, running: QueueAhead, elapsed_s: float, scale: float = 1.0) -> float:
        """Predicted seconds left of a prefill batch of the work ``running`` that started
        ``elapsed_s`` seconds ago (at least 0), on a worker ``scale`` times slower than the fit."""
        if running.requests <= 0:
            return 0.0
        return max(0.0, scale * self.prefill_seconds(running.tokens, running.images) - elapsed_s)

    def first_token_in(self, through: QueueAhead, before_s: float, tier: Tier, scale: float = 1.0) -> float:
        """Predicted seconds from now to the first token of a queued request of ``tier`` with
        the queued work ``through`` served before it, itself included (packed in full batches), after
        ``before_s`` seconds of the batch in progress, on a worker ``scale`` times slower than the fit:
        priced as its tier's predictions are (its TTFT correction, the transit; no front-end overhead,
        which it has had)."""
        return (before_s + scale * self.queue_seconds(through)) * self.ttft_corrections[tier].value + self.transit_s

    def through_own_batch(self, ahead: QueueAhead, looser: QueueAhead, tokens: int, images: int,
                          before_s: float = 0.0, arrivals: QueueAhead | None = None, window_s: float = 1.0,
                          scale: float = 1.0) -> float:
        """Predicted seconds from ``before_s`` seconds before the next batch starts (the rest of
        the batch in progress) to the end of the batch of a new request of ``tokens`` tokens and
        ``images`` images, with the queued work ``ahead`` of it served first (full batches of it,
        then what is left of it in its own batch), and in its own batch, up to the batch size and
        token budget, the looser work queued and the work that arrives until that batch starts
        (``arrivals``: what came in the last ``window_s`` seconds, at the same rate; any tier joins,
        as in the prefill scheduler: :meth:`mm_serve.vision_prefill.prefill_scheduler.PrefillScheduler.next_batch`).
        Batches take ``scale`` times the fit's seconds. Returns seconds, ``before_s`` included."""
        per_batch = self.prefill.coefficients[0]
        full, in_its_batch = divmod(ahead.requests, self.batch_size)
        share = in_its_batch / ahead.requests if ahead.requests else 0.0
        mine_tokens, mine_images = ahead.tokens * share, ahead.images * share  # ahead of it in its own batch
        wait = before_s
        if full:
            wait += scale * max(0.0, self.prefill_seconds(ahead.tokens - mine_tokens, ahead.images - mine_images)
                                + (full - 1) * per_batch)
        slots = max(0, self.batch_size - 1 - in_its_batch)
        joined: list[tuple[float, QueueAhead]] = [(min(looser.requests, slots), looser)]
        if arrivals is not None and arrivals.requests > 0 and window_s > 0:
            joined.append((min(slots - joined[0][0], arrivals.requests / window_s * wait), arrivals))
        batch_tokens, batch_images = tokens + mine_tokens, images + mine_images
        for count, work in joined:
            if count > 0 and work.requests > 0:
                add = min(work.tokens * count / work.requests, max(0.0, self.token_budget - batch_tokens))
                batch_tokens += add
                batch_images += work.images * add / work.tokens if work.tokens else 0.0
        return wait + scale * self.prefill_seconds(batch_tokens, batch_images)

    def predict(self, ahead: QueueAhead, tokens: int, images: int, decode_batch: int,
                decode_context: int, looser: QueueAhead | None = None, tier: Tier = Tier.STANDARD, reserve: int = 0,
                running: QueueAhead | None = None, running_elapsed_s: float = 0.0,
                arrivals: QueueAhead | None = None, arrivals_window_s: float = 1.0,
                prefill_worker: int | None = None, decode_worker: int | None = None,
                decode_tightest: Tier | None = None) -> Prediction:
        """TTFT and TPOT of a request of ``tier`` with ``tokens`` prompt tokens and ``images`` images.

        With the batch in progress on its prefill worker known (``running``), the TTFT's queue
        + prefill part is the rest of that batch (:meth:`remaining_seconds`) and then the batches
        up to and including its own (:meth:`through_own_batch`); without (a worker that does
        not report its batches: colocated), the wait for ``ahead`` (:meth:`queue_seconds`) plus half
        a batch of looser work (:meth:`in_progress_seconds`) plus its own prefill.

        Args:
            ahead: work queued on its prefill worker at its tier and tighter ones (without the
                batch in progress when ``running`` is given).
            decode_batch: requests its decode worker will run with it (it included).
            decode_context: context tokens of that batch (prompt and outputs, it included).
            looser: work queued there at looser tiers (likewise).
            tier: its SLO tier: each has its own TTFT correction.
            reserve: requests to keep room for on the decode worker (``tpot_reserved_s``).
            running: the batch prefilling there now (any tier), started ``running_elapsed_s`` seconds ago.
            arrivals: work dispatched to that prefill worker in the last ``arrivals_window_s`` seconds.
            prefill_worker: its index, for the worker's speed (:meth:`prefill_scale`).
            decode_worker: the decode worker's index, for its last steps (:meth:`decode_scale`).
            decode_tightest: the tightest tier running on that decode worker (None: none), for the
                paced interval under decode pacing (:meth:`paced_step_s`).
        """
        scale = self.prefill_scale(prefill_worker)
        own = scale * self.prefill_seconds(tokens, images)
        if running is None:
            queue = scale * (self.queue_seconds(ahead) + (self.in_progress_seconds(looser) if looser is not None else 0.0))
            base = queue + own
        else:
            base = self.through_own_batch(ahead, looser or QueueAhead(0, 0, 0), tokens, images,
                                          self.remaining_seconds(running, running_elapsed_s, scale), arrivals,
                                          arrivals_window_s, scale)
            queue = max(0.0, base - own)
        live = self.decode_scale(decode_worker)
        decode_fit = self.decode.predict((1.0, decode_batch, decode_context))
        paced = self.paced_step_s(tier, decode_tightest)
        work = live * decode_fit
        step = max(paced, work)
        batch = max(1, decode_batch)
        reserved = live * self.decode.predict((1.0, batch + reserve, decode_context * (batch + reserve) / batch))
        correction = self.tpot_correction.value
        return Prediction(base * self.ttft_corrections[tier].value + self.transit_s + self.overhead_s,
                          step * correction, queue, base, step, work * correction, tier=tier,
                          tpot_reserved_s=reserved * correction, own_work=(tokens, images),
                          own_fit_s=self.prefill_seconds(tokens, images), decode_work=(decode_batch, decode_context),
                          decode_fit_s=decode_fit, decode_live=live, paced_s=paced)

    def repriced(self, prediction: Prediction) -> tuple[float, float]:
        """``prediction``'s TTFT base (queue + own prefill) and decode step, in seconds, as the fits
        price them now: each scaled by the fit's price now against its price then for the request's own
        work (its prefill; one step of its decode batch), the paced interval kept as a floor. The
        corrections learn a finished request's measured / this: learned against the price made at
        admission, a fit that moved since (the first requests after a start are priced by the starting
        coefficients, which can be 10x off for a model and machine) would leave the corrections fitting
        the old fit's error, and scale every later prediction by it."""
        base = prediction.ttft_base_s
        tokens, images = prediction.own_work
        if prediction.own_fit_s > 0:
            base *= self.prefill_seconds(tokens, images) / prediction.own_fit_s
        step = prediction.tpot_step_s
        if prediction.decode_fit_s > 0:
            batch, context = prediction.decode_work
            step = max(prediction.paced_s, prediction.decode_live * self.decode.predict((1.0, batch, context)))
        return base, step

    def paced_step_s(self, tier: Tier, decode_tightest: Tier | None = None) -> float:
        """Seconds a paced decode step lasts at least once a request of ``tier`` runs on a decode worker
        whose tightest running tier is ``decode_tightest`` (None: none): the decode workers' own rule,
        :func:`mm_serve.runtime.pacing.paced_interval_s`; 0.0 unpaced."""
        ranks = [tier] if decode_tightest is None else [tier, decode_tightest]
        return paced_interval_s(self.decode_interval_s, self.decode_pacing, self.tier_tpot_s, ranks)

    def observe_prefill(self, tokens: int, images: int, seconds: float, worker: int | None = None,
                        cpu_seconds: float = 0.0, decode_requests: int = 0, decode_context: int = 0) -> None:
        """One measured prefill batch (encode + prefill) of prefill worker ``worker``: ``seconds``
        of wall-clock time and, on a CPU, ``cpu_seconds`` of the worker's own compute per thread
        (0: not measured). The fit learns the batch's cost from ``cpu_seconds`` when given, which
        other processes' time slices on its core do not inflate (a burst that keeps the front end
        decoding images on that core would otherwise be read as the cost of the batch's
        tokens or image, and priced into every later prediction); the worker's speed factor
        (:meth:`prefill_scale`) learns the wall-clock time against that cost.

        A colocated step that also decoded ``decode_requests`` requests over ``decode_context``
        tokens in the same pass has that batch's price by the decode fit, less the fit's per-step
        constant (the pass is shared), taken out of both times first: the planner's price of a mixed
        step (:mod:`mm_serve.planner.colocated_instance`) read backwards. A step the decode batch's price
        leaves nothing of is not learned."""
        if decode_requests:
            _, per_request, per_context = self.decode.coefficients
            riders = max(0.0, per_request * decode_requests + per_context * decode_context)
            seconds -= riders
            cpu_seconds = max(0.0, cpu_seconds - riders) if cpu_seconds > 0 else 0.0
            if seconds <= 0:
                return
        if worker is not None:
            speed = self.prefill_speed.setdefault(worker, RatioCorrection(half_life_s=60.0, grace_s=30.0))
            speed.observe(seconds, self.prefill_seconds(tokens, images))
        self.prefill.observe((1.0, tokens, images), cpu_seconds if cpu_seconds > 0 else seconds)

    def observe_decode(self, batch: int, context: int, seconds: float, worker: int | None = None,
                       cpu_seconds: float = 0.0) -> None:
        """One measured decode step of ``batch`` requests over ``context`` tokens of decode worker
        ``worker``, in seconds: first against the fit's price for it (:meth:`decode_scale`), then into the
        fit, which learns ``cpu_seconds`` when given (a colocated worker's CPU seconds per thread, which
        the API process decoding photos on the same cores does not inflate: its wall-clock steps stretch
        to 10x for seconds, which a fit of them would keep as a 30-60 ms step for the next ~100; the scale
        follows that)."""
        if worker is not None:
            live = self.decode_live.setdefault(worker, RatioCorrection(
                weight=DECODE_LIVE_WEIGHT, low=0.5, high=4.0, half_life_s=DECODE_LIVE_HALF_LIFE_S, grace_s=1.0))
            live.observe(seconds, self.decode.predict((1.0, batch, context)))
        self.decode.observe((1.0, batch, context), cpu_seconds if cpu_seconds > 0 else seconds)

    def observe_overhead(self, residual_s: float) -> None:
        """Measured TTFT minus its measured queue wait and prefill, in seconds."""
        if residual_s >= 0:
            self.overhead_s += OVERHEAD_WEIGHT * (residual_s - self.overhead_s)

    def observe_finished(self, prediction: Prediction, prefill_span_s: float | None, tpot_s: float | None) -> None:
        """A finished request's measured span from dispatch to first token and TPOT (seconds; None
        when not measured; the span less the prediction's grammar compile) against its prediction, as
        the fits price it now (:meth:`repriced`): refits the transit (from a request predicted to wait
        for nothing: its span less its own prefill) and the two corrections (the span less the
        transit against the queue + prefill part; the TPOT against the decode step)."""
        base, step = self.repriced(prediction)
        if prefill_span_s is not None:
            prefill_span_s -= prediction.grammar_s  # priced apart from the queue and the prefill
            if prediction.queue_s <= 0:
                residual = max(0.0, prefill_span_s - base)
                self.transit_s += TRANSIT_WEIGHT * (residual - self.transit_s)
            self.ttft_corrections[prediction.tier].observe(prefill_span_s - self.transit_s, base)
        if tpot_s is not None:
            self.tpot_correction.observe(tpot_s, step)

    def warm_start(self, profile: Profile) -> None:
        """Fit the starting coefficients to an ``mm-serve profile`` file's points (prefill batches,
        encode batches, decode steps) and make that fit the prior each online fit is pulled back
        to where live steps say nothing (:meth:`OnlineLinearFit.set_prior`); the online refit
        goes on from there."""
        for _ in range(3):  # a few passes: the fit weighs recent points most
            for p in profile.prefill:
                self.prefill.observe((1.0, p.tokens * p.batch, 0), p.seconds)
            for e in profile.encode:
                self.prefill.observe((1.0, 0, e.images), e.seconds)
            for d in profile.decode:
                self.decode.observe((1.0, d.batch, d.batch * d.context), d.seconds)
        for fit in (self.prefill, self.decode):
            fit.set_prior(fit.coefficients)

    def report(self) -> dict[str, object]:
        """Coefficients, observation counts and their age in seconds (for /health)."""
        now = time.monotonic()

        def age(fit: OnlineLinearFit) -> float | None:
            return None if fit.updated_at is None else round(now - fit.updated_at, 3)

        return {
            "prefill": {"s_per_batch": self.prefill.coefficients[0], "s_per_token": self.prefill.coefficients[1],
                        "s_per_image": self.prefill.coefficients[2], "observations": self.prefill.num_observations,
                        "age_s": age(self.prefill),
                        "worker_speed": {str(i): round(c.value, 4) for i, c in sorted(self.prefill_speed.items())}},
            "decode": {"s_per_step": self.decode.coefficients[0], "s_per_request": self.decode.coefficients[1],
                       "s_per_context_token": self.decode.coefficients[2],
                       "observations": self.decode.num_observations, "age_s": age(self.decode),
                       "worker_speed": {str(i): round(c.value, 4) for i, c in sorted(self.decode_live.items())}},
            "overhead_s": self.overhead_s,
            "transit_s": self.transit_s,
            "ttft_correction": {tier.label: round(c.value, 4) for tier, c in zip(Tier, self.ttft_corrections,
                                                                                    strict=True)},
            "tpot_correction": round(self.tpot_correction.value, 4),
        }
