"""Recursive least squares with forgetting: a linear model refitted from each new measurement.

``y ≈ θ · x``. Each :meth:`OnlineLinearFit.observe` moves θ toward the new point with the
classic RLS gain; old points fade by ``forgetting`` per observation (0.95: the last ~20
steps dominate), so a wrong start or a change of load is corrected within a few dozen
steps. Features are divided by fixed ``scales`` (their typical sizes) so one prior
covariance suits them all, and the covariance is capped at its prior so that directions
no recent point excited (e.g. images during text-only traffic) do not wind up.
"""

from __future__ import annotations

import time
from collections.abc import Sequence


class OnlineLinearFit:
    """θ of ``y ≈ θ · x`` (units of ``y`` per unit of each feature), refitted online.

    Raises (constructor):
        ValueError: lengths differ, a scale is not positive, or ``forgetting`` not in (0, 1].
    """

    def __init__(self, initial: Sequence[float], scales: Sequence[float], forgetting: float = 0.95,
                 prior_variance: float = 100.0) -> None:
        if len(initial) != len(scales) or not initial:
            raise ValueError(f"initial ({len(initial)}) and scales ({len(scales)}) must have one entry per feature")
        if any(s <= 0 for s in scales):
            raise ValueError(f"scales must be > 0, got {list(scales)}")
        if not 0 < forgetting <= 1:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        self.scales = list(scales)
        self.forgetting = forgetting
        self._theta = [c * s for c, s in zip(initial, scales, strict=True)]  # in scaled units
        k = len(initial)
        self._prior = prior_variance  # of θ in scaled units, relative to the measurement noise
        self._p = [[self._prior if i == j else 0.0 for j in range(k)] for i in range(k)]
        self.num_observations = 0
        self.updated_at: float | None = None  # time.monotonic() of the last observation

    @property
    def coefficients(self) -> list[float]:
        """θ in the units of the raw features (e.g. seconds per token)."""
        return [t / s for t, s in zip(self._theta, self.scales, strict=True)]

    def predict(self, features: Sequence[float]) -> float:
        """θ · x for raw features ``x`` (never below 0)."""
        return max(0.0, sum(c * x for c, x in zip(self.coefficients, features, strict=True)))

    def observe(self, features: Sequence[float], value: float) -> None:
        """Refit from one measurement ``value`` at raw ``features``."""
        x = [f / s for f, s in zip(features, self.scales, strict=True)]
        k = len(x)
        px = [sum(self._p[i][j] * x[j] for j in range(k)) for i in range(k)]
        denom = self.forgetting + sum(x[i] * px[i] for i in range(k))
        gain = [v / denom for v in px]
        error = value - sum(t * v for t, v in zip(self._theta, x, strict=True))
        self._theta = [t + g * error for t, g in zip(self._theta, gain, strict=True)]
        for i in range(k):
            for j in range(k):
                self._p[i][j] = (self._p[i][j] - gain[i] * px[j]) / self.forgetting
        for i in range(k):  # cap wind-up in unexcited directions
            if self._p[i][i] > self._prior:
                shrink = (self._prior / self._p[i][i]) ** 0.5
                for j in range(k):
                    self._p[i][j] *= shrink
                    self._p[j][i] *= shrink
        self.num_observations += 1
        self.updated_at = time.monotonic()
