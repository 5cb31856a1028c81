"""The media work in flight and its expected remaining time (mm_serve/admission/media_load.py)."""

from __future__ import annotations

import pytest

from mm_serve.admission.media_load import RATE_WINDOW_S, MediaLoad


def test_without_a_measured_rate_a_call_expects_as_long_again_as_it_has_spent() -> None:
    load = MediaLoad()
    ticket = load.enter(now=10.0)
    assert load.expected_remaining(ticket, now=10.04) == pytest.approx(0.04)
    load.leave(load.enter(now=10.0), now=10.01)  # one completion: still no rate
    assert load.expected_remaining(ticket, now=10.05) == pytest.approx(0.05)


def test_with_a_rate_a_call_expects_the_calls_ahead_of_it_plus_itself_over_that_rate() -> None:
    load = MediaLoad()
    for i in range(5):  # five calls left the phase over the last 0.5 s: 10 per second
        load.leave(load.enter(now=9.0), now=9.6 + 0.1 * i)
    first, second, third = (load.enter(now=9.9) for _ in range(3))
    assert load.in_flight() == 3
    assert load.expected_remaining(first, now=10.1) == pytest.approx(1 / 10)
    assert load.expected_remaining(third, now=10.1) == pytest.approx(3 / 10)
    load.leave(first, now=10.1)  # one more completion: 6 over 0.5 s; the third has one ahead now
    assert load.expected_remaining(third, now=10.1) == pytest.approx(2 / 12)
    assert load.expected_remaining(first, now=10.1) == 0.0  # no longer running


def test_old_completions_fall_out_of_the_rate() -> None:
    load = MediaLoad()
    for i in range(4):
        load.leave(load.enter(now=0.0), now=1.0 + 0.01 * i)
    ticket = load.enter(now=1.0 + RATE_WINDOW_S)
    later = 1.05 + RATE_WINDOW_S + 0.2  # past the window: back to the time spent
    assert load.expected_remaining(ticket, now=later) == pytest.approx(0.25)
    load.leave(ticket, now=later)
    assert load.in_flight() == 0
