"""SLO tiers in the schedulers: prefill order by tier then arrival, ageing, decode preemption
of the lowest tier first, displacement of a running lower-tier request by a waiting higher one."""

from __future__ import annotations

from mm_serve.runtime.request import Request, RequestStatus
from tests.policy.factories import make_prefill_scheduler, make_request, make_scheduler

INTERACTIVE, STANDARD, BATCH = 0, 1, 2


def ids(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


def always(batch: list[Request]) -> bool:
    return True


def grow(requests: list[Request], token: int = 7) -> None:
    for request in requests:
        request.append_output(token, None)


def test_prefill_queue_orders_by_tier_then_arrival() -> None:
    """Batches go interactive first, then standard, then batch; FCFS inside a tier."""
    scheduler = make_prefill_scheduler(token_budget=512, batch_size=2)
    arrivals = [("b0", BATCH), ("s0", STANDARD), ("i0", INTERACTIVE), ("s1", STANDARD), ("i1", INTERACTIVE),
                ("b1", BATCH)]
    for t, (name, rank) in enumerate(arrivals):
        request = make_request(name, 8, priority=rank)
        request.arrival_time = 100.0 + t
        scheduler.add(request)
    now = 101.0
    assert ids(scheduler.ordered(now)) == ["i0", "i1", "s0", "s1", "b0", "b1"]
    assert ids(scheduler.next_batch(always, now)) == ["i0", "i1"]
    assert ids(scheduler.next_batch(always, now)) == ["s0", "s1"]
    assert ids(scheduler.next_batch(always, now)) == ["b0", "b1"]
    assert len(scheduler) == 0


def test_a_batch_request_waiting_past_its_slo_moves_up() -> None:
    """Ageing: a batch request queued longer than its max_wait_s runs before newer interactive ones."""
    scheduler = make_prefill_scheduler(token_budget=512, batch_size=1)
    old = make_request("old-batch", 8, priority=BATCH, max_wait_s=5.0)
    old.arrival_time = 0.0
    scheduler.add(old)
    for i in range(3):
        fresh = make_request(f"i{i}", 8, priority=INTERACTIVE)
        fresh.arrival_time = 4.0 + i
        scheduler.add(fresh)
    assert ids(scheduler.ordered(now=4.5)) == ["i0", "i1", "i2", "old-batch"]  # not aged yet
    assert ids(scheduler.next_batch(always, now=5.5)) == ["old-batch"]  # waited 5.5 s > 5 s
    assert ids(scheduler.next_batch(always, now=5.5)) == ["i0"]


def test_decode_preempts_the_lowest_tier_first() -> None:
    """Out of pages, the newest request of the lowest tier is preempted, not the newest overall."""
    scheduler = make_scheduler(num_pages=4)
    batch = make_request("batch", 4, priority=BATCH)
    std = make_request("std", 4, priority=STANDARD)
    inter = make_request("inter", 8, priority=INTERACTIVE)
    for r in (batch, std, inter):
        scheduler.add(r)
    assert ids(scheduler.schedule().prefill) == ["inter", "std", "batch"]  # tier order
    assert (inter.block_table, std.block_table, batch.block_table) == ([0, 1], [2], [3])
    grow([inter, std, batch])  # each needs one more page; none is free
    out = scheduler.schedule()
    assert ids(out.preempted) == ["batch", "std"] and ids(out.decode) == ["inter"]
    assert inter.block_table == [0, 1, 3] and batch.status is RequestStatus.PREEMPTED
    # preempted requests wait in tier order: standard before batch
    assert ids(list(scheduler.waiting)) == ["std", "batch"]
    scheduler.pool.check_integrity()


def test_a_waiting_higher_tier_request_displaces_a_running_lower_tier_one() -> None:
    """An interactive request that does not fit preempts the running batch request (recompute later)."""
    scheduler = make_scheduler(num_pages=3)
    batch = make_request("batch", 8, priority=BATCH)
    scheduler.add(batch)
    assert ids(scheduler.schedule().prefill) == ["batch"] and batch.block_table == [0, 1]
    grow([batch])
    scheduler.schedule()  # decode step: batch takes its third page
    assert scheduler.pool.num_free == 0
    inter = make_request("inter", 8, priority=INTERACTIVE)
    scheduler.add(inter)
    out = scheduler.schedule()
    assert ids(out.prefill) == ["inter"] and batch.status is RequestStatus.PREEMPTED
    assert ids(list(scheduler.waiting)) == ["batch"] and scheduler.num_displaced == 1
    assert batch.num_tokens == 9 and batch.block_table == []  # recomputed from prompt + outputs later
    scheduler.pool.check_integrity()


def test_a_same_tier_request_displaces_nothing() -> None:
    scheduler = make_scheduler(num_pages=2)
    first = make_request("first", 8, priority=STANDARD)
    scheduler.add(first)
    scheduler.schedule()
    second = make_request("second", 8, priority=STANDARD)
    scheduler.add(second)
    assert scheduler.schedule().prefill == [] and first.status is RequestStatus.RUNNING
    assert scheduler.num_displaced == 0
