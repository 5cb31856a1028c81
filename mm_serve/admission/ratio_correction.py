"""A multiplicative correction learned from finished requests: measured / predicted, smoothed.

The step fits (:mod:`mm_serve.admission.online_fit`) know what one prefill batch or one
decode step costs now; what a request then lives through is more: a decode batch that grows
while it runs, the wait between its first token and a decode slot, higher-tier work that
arrives after it and is prefilled first. Those effects are systematic for a given load, so
each prediction is scaled by the exponentially weighted geometric mean of the ratio
measured / predicted over the last requests that finished (the same idea as the
front-end overhead, which is an average of measured residuals). Without new observations
the correction decays back toward 1 (half-life ``half_life_s``, once ``grace_s`` has passed
since the last one): a tier whose every request is refused teaches nothing, and a stale
pessimistic factor must not lock it out for good; requests finishing less than ``grace_s``
apart keep the plain geometric mean.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

SPREAD_WINDOW = 64  # last ratios kept for the spread
SPREAD_MIN_OBSERVATIONS = 20  # fewer: no spread (1.0)
SPREAD_MAX = 4.0
SPREAD_MAX_AGE_S = 60.0  # older ratios do not count in the spread (a passing disturbance must not stay)


class RatioCorrection:
    """``value`` = exp(EWMA of log(measured / predicted)), clamped to ``[low, high]``.

    Raises (constructor):
        ValueError: ``weight`` not in (0, 1], not ``0 < low <= 1 <= high``, ``half_life_s <= 0`` or ``grace_s < 0``.
    """

    def __init__(self, weight: float = 0.1, low: float = 0.2, high: float = 10.0, half_life_s: float = 10.0,
                 grace_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not half_life_s > 0 or grace_s < 0:
            raise ValueError(f"need half_life_s > 0 and grace_s >= 0, got {half_life_s}, {grace_s}")
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        if not 0 < low <= 1 <= high:
            raise ValueError(f"need 0 < low <= 1 <= high, got {low}, {high}")
        self.weight = weight
        self._bounds = (math.log(low), math.log(high))
        self._log = 0.0
        self.half_life_s, self.grace_s = half_life_s, grace_s
        self._clock = clock
        self._at = clock()  # when _log was last set
        self.num_observations = 0
        self._recent: deque[tuple[float, float]] = deque(maxlen=SPREAD_WINDOW)  # (when, log(measured / predicted))

    @property
    def value(self) -> float:
        """The factor to multiply a prediction by (1.0 before any observation)."""
        return math.exp(self._decayed())

    def _decayed(self) -> float:
        idle = max(0.0, self._clock() - self._at - self.grace_s)
        return self._log * 0.5 ** (idle / self.half_life_s)

    def observe(self, measured: float, predicted: float) -> None:
        """One finished request's measured and predicted value (same unit); ignored unless both > 0."""
        if not (measured > 0 and predicted > 0 and math.isfinite(measured) and math.isfinite(predicted)):
            return
        current = self._decayed()
        self._log = current + self.weight * (math.log(measured / predicted) - current)
        self._log = min(max(self._log, self._bounds[0]), self._bounds[1])
        self._at = self._clock()
        self.num_observations += 1
        self._recent.append((self._at, math.log(measured / predicted)))

    def spread(self, quantile: float) -> float:
        """How far above the typical ratio the ``quantile`` of the last :data:`SPREAD_WINDOW`
        ratios (those of the last :data:`SPREAD_MAX_AGE_S` seconds) lies: exp(their ``quantile`` −
        their median), in [1, :data:`SPREAD_MAX`]; 1.0 with fewer than
        :data:`SPREAD_MIN_OBSERVATIONS`. A prediction scaled by :attr:`value` and then by this is
        exceeded by about ``1 - quantile`` of what is measured.

        Raises:
            ValueError: ``quantile`` not in [0.5, 1].
        """
        if not 0.5 <= quantile <= 1:
            raise ValueError(f"quantile must be in [0.5, 1], got {quantile}")
        cutoff = self._clock() - SPREAD_MAX_AGE_S
        ordered = sorted(log for at, log in self._recent if at >= cutoff)
        if len(ordered) < SPREAD_MIN_OBSERVATIONS:
            return 1.0
        top = ordered[min(len(ordered) - 1, math.ceil(quantile * len(ordered)) - 1)]
        return min(SPREAD_MAX, max(1.0, math.exp(top - ordered[len(ordered) // 2])))
