"""Prefill scheduler: length buckets, lookahead, FCFS head, token budget, batch size, backpressure."""

from __future__ import annotations

import pytest

from mm_serve.runtime.request import Request
from mm_serve.vision_prefill.prefill_scheduler import BUCKET_EDGES, PrefillScheduler, length_bucket
from tests.policy.factories import make_prefill_scheduler, make_request


def ids(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


def always(batch: list[Request]) -> bool:
    return True


def queue(scheduler: PrefillScheduler, *lengths: int) -> list[Request]:
    """Add requests q0, q1, ... with the given prompt lengths."""
    requests = [make_request(f"q{i}", n) for i, n in enumerate(lengths)]
    for r in requests:
        scheduler.add(r)
    return requests


@pytest.mark.parametrize(
    ("num_tokens", "bucket"),
    [(0, 0), (1, 0), (32, 0), (33, 1), (128, 1), (129, 2), (512, 2), (513, 3), (2048, 3), (2049, 4),
     (8192, 4), (8193, 5), (10**6, 5)],
)
def test_length_bucket_edges(num_tokens: int, bucket: int) -> None:
    """Bucket i holds lengths up to BUCKET_EDGES[i] inclusive; longer ones go to the last bucket."""
    assert BUCKET_EDGES == (32, 128, 512, 2048, 8192)
    assert length_bucket(num_tokens) == bucket


def test_head_runs_first_and_only_bucket_mates_join() -> None:
    """The head starts the batch; later requests join only from the head's length bucket, in order."""
    scheduler = make_prefill_scheduler()
    queue(scheduler, 10, 100, 20, 30, 129)
    assert ids(scheduler.next_batch(always)) == ["q0", "q2", "q3"]
    assert ids(list(scheduler.queue)) == ["q1", "q4"]
    assert ids(scheduler.next_batch(always)) == ["q1"]  # q4 (bucket 2) is not a mate of q1 (bucket 1)
    assert ids(scheduler.next_batch(always)) == ["q4"] and len(scheduler) == 0


def test_lookahead_limits_the_scan_for_bucket_mates() -> None:
    """Only the first ``lookahead`` queued requests (head included) are scanned."""
    scheduler = make_prefill_scheduler(lookahead=3)
    queue(scheduler, 10, 100, 20, 30, 5)
    assert ids(scheduler.next_batch(always)) == ["q0", "q2"]  # q3, q4 are beyond the window
    assert ids(list(scheduler.queue)) == ["q1", "q3", "q4"]
    assert ids(scheduler.next_batch(always)) == ["q1"]
    assert ids(scheduler.next_batch(always)) == ["q3", "q4"]


def test_lookahead_of_one_never_batches() -> None:
    """With lookahead 1 only the head is looked at, so every batch is a single request."""
    scheduler = make_prefill_scheduler(lookahead=1)
    queue(scheduler, 10, 10, 10)
    assert [ids(scheduler.next_batch(always)) for _ in range(3)] == [["q0"], ["q1"], ["q2"]]


def test_token_budget_skips_a_mate_that_does_not_fit_and_keeps_scanning() -> None:
    """A bucket-mate over the budget is skipped (stays queued); a smaller later one still joins."""
    scheduler = make_prefill_scheduler(token_budget=40)
    queue(scheduler, 20, 25, 15, 6)
    assert ids(scheduler.next_batch(always)) == ["q0", "q2"]  # 20 + 15 = 35; + 6 would be 41
    assert ids(list(scheduler.queue)) == ["q1", "q3"]
    assert scheduler.queued_tokens == 31
    assert ids(scheduler.next_batch(always)) == ["q1", "q3"]


def test_head_over_the_budget_runs_alone() -> None:
    """The head runs even when it alone exceeds the budget (no starvation of long prompts)."""
    scheduler = make_prefill_scheduler(token_budget=16)
    queue(scheduler, 30, 5)
    assert ids(scheduler.next_batch(always)) == ["q0"]
    assert ids(scheduler.next_batch(always)) == ["q1"]


def test_batch_size_caps_the_batch() -> None:
    """No batch holds more than ``batch_size`` requests; the rest keep their order."""
    scheduler = make_prefill_scheduler(batch_size=2)
    queue(scheduler, 3, 4, 5, 6, 7)
    assert ids(scheduler.next_batch(always)) == ["q0", "q1"]
    assert ids(scheduler.next_batch(always)) == ["q2", "q3"]
    assert ids(scheduler.next_batch(always)) == ["q4"]


def test_head_of_line_is_never_overtaken() -> None:
    """A long head runs before short requests that keep arriving behind it (FCFS)."""
    scheduler = make_prefill_scheduler(token_budget=64)
    long, short = make_request("long", 200), make_request("short0", 10)
    scheduler.add(long)
    scheduler.add(short)
    assert ids(scheduler.next_batch(always)) == ["long"]
    scheduler.add(make_request("short1", 10))
    assert ids(scheduler.next_batch(always)) == ["short0", "short1"]


def test_can_fit_is_asked_for_each_candidate_batch() -> None:
    """can_fit sees the head alone, then each candidate batch; a mate that does not fit is skipped."""
    scheduler = make_prefill_scheduler()
    queue(scheduler, 10, 20, 15, 100)
    asked: list[list[str]] = []

    def fits_25_tokens(batch: list[Request]) -> bool:
        asked.append(ids(batch))
        return sum(r.num_tokens for r in batch) <= 25

    assert ids(scheduler.next_batch(fits_25_tokens)) == ["q0", "q2"]
    assert asked == [["q0"], ["q0", "q1"], ["q0", "q2"]]  # q3 is in another bucket: never asked
    assert ids(list(scheduler.queue)) == ["q1", "q3"]


def test_backpressure_returns_nothing_when_the_head_does_not_fit() -> None:
    """If the head alone does not fit, nothing runs, even a smaller request behind it."""
    scheduler = make_prefill_scheduler()
    queue(scheduler, 20, 5)
    asked: list[list[str]] = []

    def fits_10_tokens(batch: list[Request]) -> bool:
        asked.append(ids(batch))
        return sum(r.num_tokens for r in batch) <= 10

    assert scheduler.next_batch(fits_10_tokens) == []
    assert asked == [["q0"]] and ids(list(scheduler.queue)) == ["q0", "q1"]


def test_empty_queue_does_not_ask_can_fit() -> None:
    """An empty queue gives an empty batch without calling can_fit."""
    scheduler = make_prefill_scheduler()
    asked: list[int] = []

    def record(batch: list[Request]) -> bool:
        asked.append(len(batch))
        return True

    assert scheduler.next_batch(record) == [] and asked == []


def test_remove_drops_a_queued_request() -> None:
    """remove returns the queued request (keeping the others' order) or None if it is not queued."""
    scheduler = make_prefill_scheduler()
    q0, q1, q2 = queue(scheduler, 3, 4, 5)
    assert scheduler.queued_tokens == 12 and len(scheduler) == 3
    assert scheduler.remove("q1") is q1
    assert scheduler.remove("q1") is None and scheduler.remove("nope") is None
    assert list(scheduler.queue) == [q0, q2] and scheduler.queued_tokens == 8
    assert scheduler.next_batch(always) == [q0, q2] and scheduler.queued_tokens == 0


def test_a_long_request_is_split_into_chunks_and_short_ones_join_each_chunk() -> None:
    """Chunked prefill: the head gets a chunk's end; mates from any bucket join within the budget;
    put back with add_front, the rest of the long request runs next, from where its KV ends."""
    scheduler = PrefillScheduler(token_budget=320, batch_size=8, chunk_tokens=256)
    long, short, mid = queue(scheduler, 600, 10, 40)
    batch = scheduler.next_batch(always)
    assert ids(batch) == ["q0", "q1", "q2"] and long.prefill_end == 256
    assert short.prefill_end == 0 and mid.prefill_end == 0  # mates run whole
    long.num_cached_tokens, long.prefill_end = 256, 0  # what the worker does after the pass
    scheduler.add_front(long)
    late = make_request("q3", 30)
    scheduler.add(late)
    assert scheduler.queued_tokens == 600 - 256 + 30
    assert ids(scheduler.next_batch(always)) == ["q0", "q3"] and long.prefill_end == 512
    long.num_cached_tokens, long.prefill_end = 512, 0
    scheduler.add_front(long)
    assert ids(scheduler.next_batch(always)) == ["q0"] and long.prefill_end == 0  # the last 88 tokens: to the end


def test_a_long_mate_joins_as_a_chunk_and_no_chunking_keeps_buckets() -> None:
    scheduler = PrefillScheduler(token_budget=700, batch_size=8, chunk_tokens=256)
    first, second, short, third = queue(scheduler, 1000, 300, 20, 900)
    assert ids(scheduler.next_batch(always)) == ["q0", "q1", "q2"]  # 256 + 256 + 20; a third chunk is over budget
    assert (first.prefill_end, second.prefill_end, short.prefill_end) == (256, 256, 0)
    assert third.prefill_end == 0 and ids(list(scheduler.queue)) == ["q3"]
    bucketed = PrefillScheduler(token_budget=2000, batch_size=8, chunk_tokens=256)
    queue(bucketed, 100, 300, 120)
    assert ids(bucketed.next_batch(always)) == ["q0", "q2"]  # no chunk at the head: buckets hold (q1's chunk is 256)
    plain = PrefillScheduler(token_budget=2000, batch_size=8)
    long, short = queue(plain, 600, 10)
    assert ids(plain.next_batch(always)) == ["q0"] and long.prefill_end == 0  # not split, buckets kept


def test_set_chunk_restarts_the_chunk_after_a_prefix_hit() -> None:
    scheduler = PrefillScheduler(token_budget=4096, batch_size=8, chunk_tokens=256)
    (request,) = queue(scheduler, 1000)
    assert scheduler.set_chunk(request) and request.prefill_end == 256
    request.num_cached_tokens = 512  # the prefix cache held its first 512 tokens
    assert scheduler.set_chunk(request) and request.prefill_end == 768
    request.num_cached_tokens = 800
    assert not scheduler.set_chunk(request) and request.prefill_end == 0
