"""A multiplicative correction learned from finished requests: measured / predicted, smoothed.

The step fits (:mod:`mm_serve.admission.online_fit`) know what one prefill batch or one
decode step costs now; what a request then lives through is more: a decode batch that grows
while it runs, the wait between its first token and a decode slot, higher-tier work that
arrives after it and is prefilled first. Those effects are systematic for a given load, so
each prediction is scaled by the exponentially weighted geometric mean of the ratio
measured / predicted over the last requests that finished (the same idea as the
front-end overhead, which is an average of measured residuals).
"""

from __future__ import annotations

import math


class RatioCorrection:
    """``value`` = exp(EWMA of log(measured / predicted)), clamped to ``[low, high]``.

    Raises (constructor):
        ValueError: ``weight`` not in (0, 1], or not ``0 < low <= 1 <= high``.
    """

    def __init__(self, weight: float = 0.1, low: float = 0.2, high: float = 10.0) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        if not 0 < low <= 1 <= high:
            raise ValueError(f"need 0 < low <= 1 <= high, got {low}, {high}")
        self.weight = weight
        self._bounds = (math.log(low), math.log(high))
        self._log = 0.0
        self.num_observations = 0

    @property
    def value(self) -> float:
        """The factor to multiply a prediction by (1.0 before any observation)."""
        return math.exp(self._log)

    def observe(self, measured: float, predicted: float) -> None:
        """One finished request's measured and predicted value (same unit); ignored unless both > 0."""
        if not (measured > 0 and predicted > 0 and math.isfinite(measured) and math.isfinite(predicted)):
            return
        self._log += self.weight * (math.log(measured / predicted) - self._log)
        self._log = min(max(self._log, self._bounds[0]), self._bounds[1])
        self.num_observations += 1
