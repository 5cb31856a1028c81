"""Each refusable tier's attainment feedback on its TTFT and TPOT limits, fed by served requests."""

from __future__ import annotations

from mm_serve.admission.attainment_feedback import FEEDBACK_SLOS, AttainmentFeedback
from mm_serve.config import ServiceConfig
from mm_serve.ground.tiers import NEVER_REFUSED, Tier


class TierFeedback:
    """The :class:`AttainmentFeedback` of every (tier, SLO) pair; not thread-safe (the caller locks)."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.factors = {(tier, slo): AttainmentFeedback(config.slo.of(tier).attainment)
                        for tier in Tier for slo in FEEDBACK_SLOS}

    @property
    def applied(self) -> bool:
        """Whether the factors scale anything: the feedback and prediction both on."""
        return self.config.admission.attainment_feedback and self.config.admission.predict

    def factor(self, tier: Tier, slo: str) -> float:
        """What the admission limit on ``slo`` ("ttft" or "tpot") of ``tier`` is multiplied by now
        (1.0 when the tier meets its aim, or with the feedback or prediction off)."""
        return self.factors[(tier, slo)].value if self.applied else 1.0

    def observe(self, tier: Tier, ttft_s: float, tpot_s: float) -> None:
        """One served request of ``tier`` (its TTFT and TPOT, seconds), late or in time on each SLO,
        each × (1 + ``admission.margin``) when the margin is negative. The server measures from the
        call's arrival to the token's receipt here; the client also lives through its connection,
        the server's parsing and the stream's delivery, which the margin's headroom is for."""
        if tier == NEVER_REFUSED:
            return
        slo, bound = self.config.slo.of(tier), min(1.0, 1.0 + self.config.admission.margin)
        self.factors[(tier, "ttft")].observe(ttft_s > bound * slo.ttft_s)
        self.factors[(tier, "tpot")].observe(tpot_s > bound * slo.tpot_s)

    def report(self) -> dict[str, dict[str, object]]:
        """Per refusable tier: each SLO's factor as applied, and the late and in-time requests seen."""
        applied = self.applied
        return {tier.label: {slo: {"factor": round(self.factors[(tier, slo)].value if applied else 1.0, 4),
                                   "late": self.factors[(tier, slo)].late,
                                   "in_time": self.factors[(tier, slo)].in_time} for slo in FEEDBACK_SLOS}
                for tier in Tier if tier != NEVER_REFUSED}
