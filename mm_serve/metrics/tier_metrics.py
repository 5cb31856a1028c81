"""Per-tier admission and SLO metrics (prometheus-client), all named ``mm_serve_tier_*``.

* ``mm_serve_tier_admitted{tier}``: API calls admitted;
* ``mm_serve_tier_rejected{tier, reason}``: calls refused at admission, by reason
  (``work_limit``, ``queued_requests``, ``queued_tokens``, ``image_bytes``, ``ttft_slo``, ``tpot_slo``);
* ``mm_serve_tier_finished{tier}``, ``mm_serve_tier_slo_met{tier}``: engine requests (one per
  prompt and choice: a call with ``n`` 3 counts 3) that finished with output by a stop or the
  length limit (not cancelled or failed), and those that met both their tier's TTFT and TPOT SLOs;
* ``mm_serve_tier_attainment{tier}``: the fraction of the two, since start;
* ``mm_serve_tier_ttft_prediction_error_seconds{tier}``: predicted minus measured TTFT.
* ``mm_serve_tier_admission_limit_factor{tier, slo}``: the attainment feedback's factor on the
  tier's ``ttft`` or ``tpot`` admission limit (read when scraped, :meth:`TierMetrics.follow_limit_factor`).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mm_serve.config import SLOConfig
from mm_serve.engine.request_state import RequestState
from mm_serve.ground.tiers import Tier

# Seconds, symmetric around 0: predicted minus measured TTFT.
ERROR_BUCKETS = tuple(sorted({s * b for b in (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
                              for s in (-1, 1)}))


class TierMetrics:
    """The per-tier series above, in ``registry``."""

    def __init__(self, registry: CollectorRegistry, slo: SLOConfig) -> None:
        self.slo = slo
        self.admitted = Counter("mm_serve_tier_admitted", "API calls admitted, by SLO tier.", ("tier",),
                                registry=registry)
        self.rejected = Counter("mm_serve_tier_rejected", "API calls refused at admission, by SLO tier and reason.",
                                ("tier", "reason"), registry=registry)
        self.finished = Counter("mm_serve_tier_finished", "Engine requests finished with output, by SLO tier.",
                                ("tier",), registry=registry)
        self.met = Counter("mm_serve_tier_slo_met", "Engine requests that met their tier's TTFT and TPOT SLOs.",
                           ("tier",), registry=registry)
        self.attainment = Gauge("mm_serve_tier_attainment", "SLO attainment since start (met / finished), by tier.",
                                ("tier",), registry=registry)
        self.prediction_error = Histogram(
            "mm_serve_tier_ttft_prediction_error_seconds", "Predicted minus measured TTFT of admitted requests.",
            ("tier",), registry=registry, buckets=ERROR_BUCKETS)
        self.at_deadline = Counter(
            "mm_serve_tier_decided_at_deadline", "API calls decided at admission.decide_within_ms, their media work "
            "still running: committed (admitted whatever their later prediction) or refused.",
            ("tier", "outcome"), registry=registry)
        self.limit_factor = Gauge(
            "mm_serve_tier_admission_limit_factor", "What the tier's admission limit on an SLO is multiplied by now: "
            "1 while its admitted requests meet their attainment aim, less while they miss it (attainment feedback).",
            ("tier", "slo"), registry=registry)
        self._counts: dict[Tier, list[int]] = {}

    def follow_limit_factor(self, tier: Tier, slo: str, read: Callable[[], float]) -> None:
        """Report ``read()`` as the limit factor of ``tier`` on ``slo``, read at each scrape."""
        self.limit_factor.labels(tier=tier.label, slo=slo).set_function(read)

    def observe_admission(self, tier: Tier, reason: str | None) -> None:
        """One call admitted (``reason`` None) or refused for ``reason``."""
        if reason is None:
            self.admitted.labels(tier=tier.label).inc()
        else:
            self.rejected.labels(tier=tier.label, reason=reason).inc()

    def observe_decided_at_deadline(self, tier: Tier, committed: bool) -> None:
        """One call decided at its decision deadline: committed (admitted) or refused."""
        self.at_deadline.labels(tier=tier.label, outcome="committed" if committed else "refused").inc()

    def observe_finished(self, state: RequestState) -> None:
        """One finished engine request (receiver thread): attainment and prediction error."""
        tier, served = state.tier, state.served_latency()
        if tier is None or served is None:
            return  # cancelled (client gone: 499) or failed: not a served request, neither met nor missed
        ttft, tpot = served
        met = self.slo.of(tier).met(ttft, tpot)
        counts = self._counts.setdefault(tier, [0, 0])
        counts[0] += 1
        counts[1] += int(met)
        label = tier.label
        self.finished.labels(tier=label).inc()
        if met:
            self.met.labels(tier=label).inc()
        self.attainment.labels(tier=label).set(counts[1] / counts[0])
        if state.predicted_ttft_s is not None:
            self.prediction_error.labels(tier=label).observe(state.predicted_ttft_s - ttft)
