"""The media work in flight and its expected remaining time (mm_serve/admission/media_load.py)."""

from __future__ import annotations

import pytest

from mm_serve.admission.media_load import RATE_WINDOW_S, MediaLoad


def test_work_ahead_over_the_measured_throughput() -> None:
    """5 calls of 2 MP, one at a time, each 0.1 s, with 0.1 s pauses between them: 10 MP in 0.5 s busy, 20 MP
    per second (the rate they left at, 10 MP/s, is the rate they came at: it priced calls twice as long)."""
    load = MediaLoad(cores=2)
    for i in range(5):
        load.leave(load.enter(2.0, now=9.0 + 0.2 * i), now=9.1 + 0.2 * i)
    first, second, third = (load.enter(w, now=10.05) for w in (4.0, 1.0, 1.0))
    assert load.in_flight() == 3
    assert load.expected_remaining(first, now=10.1) == pytest.approx(4.0 / 20)
    assert load.expected_remaining(third, now=10.1) == pytest.approx(6.0 / 20)  # its own and the work ahead
    load.leave(first, now=10.1)  # 14 MP in 0.55 s busy now; the third has 1 MP ahead
    assert load.expected_remaining(third, now=10.1) == pytest.approx(2.0 / (14.0 / 0.55))
    assert load.expected_remaining(first, now=10.1) == 0.0  # no longer running


def test_calls_in_the_phase_together_count_their_shared_time_once() -> None:
    """4 calls of 3 MP in the phase together from 0.0, leaving at 0.3, 0.4, 0.5, 0.6: 12 MP in 0.6 s busy."""
    load = MediaLoad(cores=2)
    tickets = [load.enter(3.0, now=0.0) for _ in range(4)]
    for i, ticket in enumerate(tickets):
        load.leave(ticket, now=0.3 + 0.1 * i)
    late = load.enter(2.0, now=0.7)
    assert load.expected_remaining(late, now=0.7) == pytest.approx(2.0 / 20.0)


def test_never_less_than_the_time_already_spent() -> None:
    load = MediaLoad(cores=2)
    for i in range(3):  # fast small calls: 100 MP/s
        load.leave(load.enter(1.0, now=0.97), now=0.98 + 0.01 * i)
    ticket = load.enter(1.0, now=0.5)
    assert load.expected_remaining(ticket, now=1.0) == pytest.approx(0.5)


def test_a_burst_after_a_quiet_spell_uses_the_throughput_last_measured() -> None:
    load = MediaLoad(cores=2)
    for i in range(4):  # 4 MP over 0.3 s then nothing for a minute
        load.leave(load.enter(1.0, now=1.0), now=1.0 + 0.1 * i)
    burst = [load.enter(16.0, now=60.0) for _ in range(10)]
    assert load.expected_remaining(burst[-1], now=60.03) == pytest.approx(160.0 / (4.0 / 0.3), rel=1e-6)


def test_before_anything_was_measured_the_oldest_call_bounds_the_throughput() -> None:
    """A first burst on a fresh server: 40 calls of 40 MP; the oldest has run 0.1 s without
    finishing, so the process gets through at most 40 MP / 0.1 s per core: the 40th call expects
    its 1,600 MP ahead to take at least 1600 / 800 = 2 s, not the 30 ms it has spent."""
    load = MediaLoad(cores=2)
    tickets = [load.enter(40.0, now=0.0 + 0.0025 * i) for i in range(40)]
    assert load.expected_remaining(tickets[-1], now=0.1) == pytest.approx(1600.0 / 800.0)
    assert load.expected_remaining(tickets[0], now=0.1) == pytest.approx(0.1)  # its own 40 MP: spent bounds it


def test_old_completions_fall_out_of_the_window_but_not_out_of_memory() -> None:
    load = MediaLoad(cores=1)
    for i in range(4):
        load.leave(load.enter(1.0, now=1.0), now=1.0 + 0.01 * i)  # 4 MP in 0.03 s
    ticket = load.enter(1.0, now=2.0 + RATE_WINDOW_S)
    assert load.expected_remaining(ticket, now=2.1 + RATE_WINDOW_S) == pytest.approx(0.1)  # spent > 1 / 133
    load.leave(ticket, now=2.2 + RATE_WINDOW_S)
    assert load.in_flight() == 0


def test_work_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        MediaLoad().enter(0.0)
