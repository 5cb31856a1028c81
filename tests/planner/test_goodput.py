"""Goodput search: geometric bisection for the max rate meeting the attainment target."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mm_serve.planner.goodput import max_rate


def step_attainment(capacity: float) -> tuple[list[float], Callable[[float], float]]:
    probes: list[float] = []

    def attainment(rate: float) -> float:
        probes.append(rate)
        return 1.0 if rate <= capacity else 0.5

    return probes, attainment


@pytest.mark.parametrize(("capacity", "upper"), [(7.3, 10.0), (7.3, 1.0), (0.9, 50.0)])
def test_finds_the_threshold_within_tolerance(capacity: float, upper: float) -> None:
    probes, fn = step_attainment(capacity)
    got = max_rate(fn, 0.9, upper, rel_tol=0.02)
    assert capacity / 1.02 <= got <= capacity
    assert len(probes) <= 12


def test_zero_when_even_the_last_floor_fails() -> None:
    probes, fn = step_attainment(1e-6)
    assert max_rate(fn, 0.9, 10.0, span=64, max_shrink=2) == 0.0
    assert min(probes) == pytest.approx(10.0 / 64**2)


def test_a_bound_far_too_high_still_finds_the_rate() -> None:
    """The analytic bound can be off by orders of magnitude; lower floors are tried."""
    probes, fn = step_attainment(0.01)
    got = max_rate(fn, 0.9, 10.0, rel_tol=0.02, span=64)
    assert 0.01 / 1.02 <= got <= 0.01
    assert len(probes) <= 14


def test_growth_stops_at_its_cap() -> None:
    assert max_rate(lambda r: 1.0, 0.9, 1.0, max_growth=3) == 8.0


def test_a_probe_that_always_passes_stops_at_the_ceiling() -> None:
    """A run too short to reveal overload passes at any rate: the answer is the ceiling (the most the
    profiled step times allow), not the bound doubled ``max_growth`` times, and no probe goes above it."""
    probes: list[float] = []

    def always(rate: float) -> float:
        probes.append(rate)
        return 1.0

    assert max_rate(always, 0.9, 10.0, ceiling=25.0) == 25.0
    assert max(probes) == 25.0


def test_a_ceiling_below_the_bound_is_probed_first() -> None:
    probes, fn = step_attainment(7.3)
    got = max_rate(fn, 0.9, 100.0, rel_tol=0.02, ceiling=8.0)
    assert 7.3 / 1.02 <= got <= 7.3
    assert probes[0] == 8.0 and max(probes) == 8.0


def test_rejects_bad_upper_bound() -> None:
    with pytest.raises(ValueError):
        max_rate(lambda r: 1.0, 0.9, 0.0)
    with pytest.raises(ValueError):
        max_rate(lambda r: 1.0, 0.9, 1.0, ceiling=0.0)
