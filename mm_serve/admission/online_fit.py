"""Exponentially weighted least squares, refitted from each new measurement, with a prior and θ ≥ 0.

``y ≈ θ · x``. Each :meth:`OnlineLinearFit.observe` adds a point to decayed sufficient
statistics (``A = Σ λ^age x xᵀ``, ``b = Σ λ^age x y``); old points fade by ``forgetting``
per observation (0.95: the last ~20 points dominate), so a wrong start or a change of
load is corrected within a few dozen points. θ is the minimiser of the weighted squared
error plus a Gaussian prior's pull toward the starting coefficients θ₀, over θ ≥ 0 (every
coefficient here is a time per unit of work; an exact active-set solve over the ≤ 2^k
faces, k ≤ 4 features). This is the posterior mode of Bayesian linear regression
(Bishop, *Pattern Recognition and Machine Learning*, 2006, §3.3) restricted to θ ≥ 0.

The prior is *relative*: coefficient ``i`` has a standard deviation of ``θ₀ᵢ`` (at least
:data:`PRIOR_FLOOR` of the prior's price of a typical point, all features at their
``scales``), and a measurement's noise is taken as a share of that typical price, so
``prior_weight`` = (noise share / prior's relative uncertainty)². Where the data fix only a
sum of terms (every batch has one image and about the same tokens; a burst repeating one
image has it encoded in one batch and cached in the next dozen), the fit then moves each
term in proportion to its prior share instead of loading the whole difference onto one
small coefficient; and a coefficient the recent points say nothing about (no image
encoded for a while) drifts back to its start as its old points fade. An absolute ridge
(0.01 s² per unit) would let a single slow batch with one image set the image term to 50x
its start for good, and later distinct-image batches would then move a batch's whole time
onto the token term.

Why not recursive least squares (RLS): with collinear features (a decode step's batch size
and its context tokens grow together; every llava prompt has one image and ~the same tokens)
and thousands of steps, RLS's covariance update loses positive definiteness to rounding and
θ diverges (to coefficients of tens or hundreds of seconds, of either sign, which refuses
every request for its TPOT).
The sufficient statistics here stay positive semidefinite by construction, the prior
keeps the solve well conditioned, and the sign constraint keeps extrapolation (a long
queue, a larger batch) from going negative. Features are divided by fixed ``scales``
(their typical sizes).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

MAX_FEATURES = 4  # the active-set solve enumerates 2^k faces
PRIOR_WEIGHT = 0.01  # (10 % measurement noise / 100 % prior uncertainty)²
PRIOR_FLOOR = 0.1  # a coefficient's prior deviation is at least this share of a typical point's price


class OnlineLinearFit:
    """θ of ``y ≈ θ · x`` (units of ``y`` per unit of each feature, all ≥ 0), refitted online.

    Raises (constructor):
        ValueError: lengths differ, more than :data:`MAX_FEATURES` features, a scale not
            positive, ``forgetting`` not in (0, 1], or ``prior_weight`` not positive.
    """

    def __init__(self, initial: Sequence[float], scales: Sequence[float], forgetting: float = 0.95,
                 prior_weight: float = PRIOR_WEIGHT) -> None:
        if len(initial) != len(scales) or not initial:
            raise ValueError(f"initial ({len(initial)}) and scales ({len(scales)}) must have one entry per feature")
        if len(initial) > MAX_FEATURES:
            raise ValueError(f"at most {MAX_FEATURES} features, got {len(initial)}")
        if any(s <= 0 for s in scales):
            raise ValueError(f"scales must be > 0, got {list(scales)}")
        if not 0 < forgetting <= 1:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        self.scales = list(scales)
        self.forgetting = forgetting
        self.prior_weight = prior_weight
        k = len(initial)
        self._prior: list[float] = []  # θ₀ in scaled units
        self._precision: list[float] = []  # the prior's pull on each scaled coefficient
        self.set_prior(initial)
        self._a = [[0.0] * k for _ in range(k)]
        self._b = [0.0] * k
        self._theta = list(self._prior)
        self._stale = False
        self.num_observations = 0
        self.updated_at: float | None = None  # time.monotonic() of the last observation

    @property
    def coefficients(self) -> list[float]:
        """θ in the units of the raw features (e.g. seconds per token), each ≥ 0."""
        if self._stale:
            self._theta = self._solve()
            self._stale = False
        return [t / s for t, s in zip(self._theta, self.scales, strict=True)]

    def set_prior(self, start: Sequence[float]) -> None:
        """Make ``start`` (raw units, one per feature; negatives count as 0) the coefficients
        the prior pulls toward, with deviations relative to them (module docstring); the
        measurements seen so far stay.

        Raises:
            ValueError: not one value per feature.
        """
        if len(start) != len(self.scales):
            raise ValueError(f"start ({len(start)}) must have one entry per feature ({len(self.scales)})")
        self._prior = [max(0.0, c) * s for c, s in zip(start, self.scales, strict=True)]
        typical = sum(self._prior) or 1.0  # the prior's price of a point with every feature at its scale
        deviation = [max(c, PRIOR_FLOOR * typical) for c in self._prior]
        self._precision = [self.prior_weight * (typical / d) ** 2 for d in deviation]
        self._stale = True

    def predict(self, features: Sequence[float]) -> float:
        """θ · x for raw features ``x`` (never below 0)."""
        return max(0.0, sum(c * x for c, x in zip(self.coefficients, features, strict=True)))

    def observe(self, features: Sequence[float], value: float) -> None:
        """Add one measurement ``value`` at raw ``features``; a non-finite one is ignored."""
        x = [f / s for f, s in zip(features, self.scales, strict=True)]
        if not all(map(_finite, (*x, value))):
            return
        lam, k = self.forgetting, len(x)
        for i in range(k):
            row = self._a[i]
            for j in range(k):
                row[j] = lam * row[j] + x[i] * x[j]
            self._b[i] = lam * self._b[i] + x[i] * value
        self._stale = True
        self.num_observations += 1
        self.updated_at = time.monotonic()

    def _solve(self) -> list[float]:
        """argmin over θ ≥ 0 of θᵀMθ − 2vᵀθ, M = A + diag(μ), v = b + μ ⊙ θ₀ (μ: the prior's
        precisions): the best feasible stationary point over the faces (sets of free
        coefficients, the others 0)."""
        k, mu = len(self._b), self._precision
        m = [[self._a[i][j] + (mu[i] if i == j else 0.0) for j in range(k)] for i in range(k)]
        v = [self._b[i] + mu[i] * self._prior[i] for i in range(k)]
        best, best_cost = [0.0] * k, 0.0
        for size in range(1, k + 1):
            for free in itertools.combinations(range(k), size):
                sub = _solve_linear([[m[i][j] for j in free] for i in free], [v[i] for i in free])
                if sub is None or min(sub) < 0:
                    continue
                theta = [0.0] * k
                for i, t in zip(free, sub, strict=True):
                    theta[i] = t
                cost = sum(theta[i] * m[i][j] * theta[j] for i in free for j in free) - 2 * sum(
                    v[i] * theta[i] for i in free)
                if cost < best_cost:
                    best, best_cost = theta, cost
        return best


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def _solve_linear(m: list[list[float]], v: list[float]) -> list[float] | None:
    """x with ``m x = v`` by Gaussian elimination with partial pivoting; None when singular."""
    n = len(v)
    rows = [[*m[i], v[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) < 1e-300:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            f = rows[r][col] / rows[col][col]
            for c in range(col, n + 1):
                rows[r][c] -= f * rows[col][c]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (rows[i][n] - sum(rows[i][j] * x[j] for j in range(i + 1, n))) / rows[i][i]
    return x
