"""Feedback from measured attainment to the admission limit of one tier and one SLO.

The predictor's corrections (:mod:`mm_serve.admission.ratio_correction`) fix its *typical*
error; what they cannot see is the tail a given load produces (a burst behind an admitted
request, a decode batch that fills after it joined). So each tier's limits are also scaled
by a factor learned from what its admitted requests then did: every finished request that
was late on an SLO lowers that SLO's factor a step, every one in time raises it by a
fraction of a step, in the proportion that balances at the aim (half way from the tier's
attainment target to 100 %: a 90 % target aims at 95 %). While the tier meets the aim the
factor stays at 1 and admission is exactly the configured rule; below it the limit tightens
until fewer requests are admitted into queues that would make them late. It is the additive
balance of a stochastic-approximation (Robbins-Monro) controller of the miss rate, in log
space so that the factor stays positive; without new observations it decays back toward 1
(a tier refused entirely sees no outcome and must not stay locked down).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

FEEDBACK_STEP = 0.08  # log-factor lowered per late request (an 8 % tighter limit)
FEEDBACK_FLOOR = 0.5  # the limit never tightens below half the configured one
FEEDBACK_HALF_LIFE_S = 20.0  # with no outcome, the log-factor halves this often
FEEDBACK_SNAP = 0.995  # a factor this close to 1 is 1 (the decay only approaches it)
FEEDBACK_SLOS = ("ttft", "tpot")  # the SLOs of a tier that each have their own factor


class AttainmentFeedback:
    """The factor (in ``[floor, 1]``) to multiply one tier's admission limit on one SLO by.

    Raises (constructor):
        ValueError: ``target`` not in (0, 1], ``step <= 0``, ``floor`` not in (0, 1] or ``half_life_s <= 0``.
    """

    def __init__(self, target: float, step: float = FEEDBACK_STEP, floor: float = FEEDBACK_FLOOR,
                 half_life_s: float = FEEDBACK_HALF_LIFE_S, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < target <= 1:
            raise ValueError(f"target must be in (0, 1], got {target}")
        if not step > 0 or not 0 < floor <= 1 or not half_life_s > 0:
            raise ValueError(f"need step > 0, 0 < floor <= 1, half_life_s > 0; got {step}, {floor}, {half_life_s}")
        self.aim = target + (1 - target) / 2
        self.step = step
        self._rise = step * (1 - self.aim) / self.aim  # per request in time: balances the steps down at the aim
        self._floor = math.log(floor)
        self.half_life_s = half_life_s
        self._clock = clock
        self._log = 0.0
        self._at = clock()
        self.late = 0
        self.in_time = 0

    @property
    def value(self) -> float:
        """The factor now: 1.0 until requests are late more often than the aim allows, and again
        once it has come back within :data:`FEEDBACK_SNAP` of 1."""
        factor = math.exp(self._decayed())
        return 1.0 if factor >= FEEDBACK_SNAP else factor

    def _decayed(self) -> float:
        return self._log * 0.5 ** (max(0.0, self._clock() - self._at) / self.half_life_s)

    def observe(self, late: bool) -> None:
        """One admitted request's outcome on this SLO: ``late`` (over it) or in time."""
        current = self._decayed()
        self._log = max(self._floor, min(0.0, current - self.step if late else current + self._rise))
        self._at = self._clock()
        if late:
            self.late += 1
        else:
            self.in_time += 1
