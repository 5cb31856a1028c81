"""The media work in flight and its expected remaining time (mm_serve/admission/media_load.py)."""

from __future__ import annotations

import pytest

from mm_serve.admission.media_load import START_SECONDS, MediaLoad, MediaWork

SMALL = MediaWork(1, 0.003)  # a 64 x 48 image
PHOTO = MediaWork(1, 12.0)  # a 4000 x 3000 photo


def test_a_burst_of_small_images_prices_calls_not_megapixels() -> None:
    """12 small-image calls in the phase together, leaving 10 ms apart: the phase was busy 0.12 s for
    12 calls and 0.04 MP, so it learns ~10 ms a call, and a photo behind two of them is priced at their
    share plus its megapixels at the per-megapixel start (by megapixels alone, the calls' 0.33 MP/s
    put a 12 MP photo at 36 s)."""
    load = MediaLoad(cores=2)
    tickets = [load.enter(SMALL, now=0.0) for _ in range(12)]
    for i, ticket in enumerate(tickets):
        load.leave(ticket, now=0.01 * (i + 1))
    per_call, per_megapixel = load.fit.coefficients
    assert per_call == pytest.approx(0.01, rel=0.15)  # the start pulls a little
    assert per_megapixel == pytest.approx(START_SECONDS[1], rel=0.05)
    ahead = [load.enter(SMALL, now=1.0) for _ in range(2)]
    photo = load.enter(PHOTO, now=1.0)
    assert load.expected_remaining(photo, now=1.01) == pytest.approx(3 * per_call + (12.0 + 2 * 0.003) * per_megapixel, rel=1e-6)
    assert load.expected_remaining(ahead[0], now=1.01) == pytest.approx(0.01)  # its own 10 ms: spent bounds it
    assert 0.15 < load.expected_remaining(photo, now=1.01) < 0.3


def test_photos_processed_together_teach_the_megapixel_part() -> None:
    """4 photos in the phase together from 0.0, leaving at 0.25, 0.5, 0.75, 1.0: each 0.25 s of busy
    time, about 21 ms a megapixel; the fifth photo behind two more expects three photos' time."""
    load = MediaLoad(cores=2)
    tickets = [load.enter(PHOTO, now=0.0) for _ in range(4)]
    for i, ticket in enumerate(tickets):
        load.leave(ticket, now=0.25 * (i + 1))
    assert load.seconds(PHOTO) == pytest.approx(0.25, rel=0.05)
    ahead = [load.enter(PHOTO, now=2.0) for _ in range(2)]
    fifth = load.enter(PHOTO, now=2.0)
    assert load.expected_remaining(fifth, now=2.01) == pytest.approx(0.75, rel=0.05)
    for ticket in ahead:
        load.leave(ticket, now=2.5)
    assert load.in_flight() == 1


def test_calls_one_at_a_time_are_timed_by_their_stays_not_their_pace() -> None:
    """5 photos one at a time, each 0.1 s in the phase, 1 s apart: the pauses are not busy time."""
    load = MediaLoad(cores=2)
    for i in range(5):
        load.leave(load.enter(PHOTO, now=10.0 + i), now=10.1 + i)
    assert load.seconds(PHOTO) == pytest.approx(0.1, rel=0.05)


def test_never_less_than_the_time_already_spent() -> None:
    load = MediaLoad(cores=2)
    for i in range(3):
        load.leave(load.enter(SMALL, now=0.97), now=0.98 + 0.01 * i)
    ticket = load.enter(SMALL, now=0.5)
    assert load.expected_remaining(ticket, now=1.0) == pytest.approx(0.5)


def test_before_anything_was_measured_the_oldest_call_bounds_the_throughput() -> None:
    """A first burst on a fresh server: 40 calls of 40 MP; the oldest has run 0.1 s without finishing,
    so the one media thread gets through at most one such call per 0.1 s: the 40th expects at least
    40 x 0.1 = 4 s, not the 30 ms it has spent; its own (the first) is bounded by its 0.1 s. With 8
    threads on 16 cores the calls ahead share them (1 + 39 / 8 calls' time); 8 threads on 2 cores
    share the 2 cores."""
    load = MediaLoad(cores=2)
    tickets = [load.enter(MediaWork(1, 40.0), now=0.0 + 0.0025 * i) for i in range(40)]
    assert load.expected_remaining(tickets[-1], now=0.1) == pytest.approx(4.0)
    assert load.expected_remaining(tickets[0], now=0.1) == pytest.approx(0.1)
    assert load.expected_remaining(10**6, now=0.1) == 0.0  # no such ticket running
    for cores, threads in ((16, 8), (2, 2)):
        wide = MediaLoad(cores=cores, lanes=8)
        tickets = [wide.enter(MediaWork(1, 40.0), now=0.0 + 0.0025 * i) for i in range(40)]
        assert wide.expected_remaining(tickets[-1], now=0.1) == pytest.approx(0.1 * (1 + 39 / threads))


def test_a_leave_of_an_unknown_ticket_changes_nothing() -> None:
    load = MediaLoad(cores=1)
    load.leave(7, now=1.0)
    assert load.fit.num_observations == 0 and load.in_flight() == 0


@pytest.mark.parametrize("work", [(0, 1.0), (1, -1.0), (1, float("nan"))])
def test_work_needs_a_prompt_and_nonnegative_megapixels(work: tuple[int, float]) -> None:
    with pytest.raises(ValueError, match="at least one prompt"):
        MediaWork(*work)


def test_fetched_images_and_budget_waits_teach_nothing_and_pass_no_time_on() -> None:
    """A call that fetched its image from a slow host (3 s in the phase; size undeclared) and one that
    waited 2 s for the image byte budget leave the fit as it was (learned, three such fetches would make
    the per-call part 0.6 s); the small call that leaves after them is timed from their leaving."""
    load = MediaLoad(cores=2)
    for i in range(10):  # small calls, 10 ms each
        load.leave(load.enter(SMALL, now=float(i)), now=i + 0.01)
    before = load.fit.coefficients
    fetched = load.enter(MediaWork(1, 1.0, known=False), now=20.0)
    waited = load.enter(PHOTO, now=20.0)
    small = load.enter(SMALL, now=20.0)
    load.leave(fetched, now=23.0)
    load.leave(waited, now=23.0, learn=False)
    assert load.fit.coefficients == before and load.fit.num_observations == 10
    load.leave(small, now=23.01)
    assert load.fit.num_observations == 11
    assert load.fit.coefficients[0] == pytest.approx(before[0], rel=0.05)  # it learned 10 ms, not 3 s
    assert load.report() == {"s_per_prompt": load.fit.coefficients[0], "s_per_megapixel": load.fit.coefficients[1],
                             "observations": 11, "in_flight": 0}


def test_the_line_of_the_media_threads_orders_the_wait() -> None:
    """Two photos of the batch rank are in the phase; an interactive photo that comes after them waits
    for no batch photo (the threads take it first), a standard one behind it for the interactive one, a
    call without an image (tokenized apart) for none; with two threads the others' work is shared."""
    def measured(load: MediaLoad) -> MediaLoad:  # 4 photos one at a time, 0.25 s each
        for i in range(4):
            load.leave(load.enter(PHOTO, now=float(i)), now=i + 0.25)
        return load

    load = measured(MediaLoad(cores=2))
    per_photo = load.seconds(PHOTO)
    for _ in range(2):
        load.enter(PHOTO, now=10.0, rank=2)
    interactive = load.enter(PHOTO, now=10.0, rank=0)
    standard = load.enter(PHOTO, now=10.0, rank=1)
    text = load.enter(MediaWork(1, 0.0), now=10.0, rank=None)
    assert per_photo == pytest.approx(0.25, rel=0.05)
    assert load.expected_remaining(interactive, now=10.0) == pytest.approx(per_photo)
    assert load.expected_remaining(standard, now=10.0) == pytest.approx(2 * per_photo)
    assert load.expected_remaining(text, now=10.0) == pytest.approx(load.seconds(MediaWork(1, 0.0)))
    # still waiting for its image bytes, the interactive photo waits for the batch photos holding them
    assert load.expected_remaining(interactive, now=10.0, in_line=False) == pytest.approx(3 * per_photo)
    two = measured(MediaLoad(cores=2, lanes=2))
    for rank in (0, 0, 0):
        two.enter(PHOTO, now=10.0, rank=rank)
    last = two.enter(PHOTO, now=10.0, rank=0)
    assert two.expected_remaining(last, now=10.0) == pytest.approx(per_photo + 3 * per_photo / 2)
