"""Continuous-batching scheduler: FCFS admission, exact page ids, recompute preemption, finish."""

from __future__ import annotations

from mm_serve.kernels.page_pool import PagePool
from mm_serve.runtime.request import Request, RequestStatus
from mm_serve.text_decode.scheduler import ContinuousBatchingScheduler
from tests.policy.factories import create_requests, make_request, make_scheduler


def ids(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


def grow(requests: list[Request], token: int = 7) -> None:
    """Give each request one more output token (what a step's sampling does)."""
    for request in requests:
        request.append_output(token, None)


def test_admission_is_fcfs_within_the_token_budget() -> None:
    """A request that would overflow the budget stops admission; a smaller one behind it waits."""
    scheduler = make_scheduler(num_pages=32, prefill_token_budget=16)
    r0, r1, r2 = create_requests(3, 6)
    r3 = make_request("r3", 2)
    for r in (r0, r1, r2, r3):
        scheduler.add(r)
    out = scheduler.schedule()
    assert ids(out.prefill) == ["r0", "r1"] and out.decode == [] and out.preempted == []
    assert (r0.block_table, r1.block_table) == ([0, 1], [2, 3])
    assert ids(list(scheduler.waiting)) == ["r2", "r3"]
    assert [r.status for r in (r0, r1, r2, r3)] == [RequestStatus.RUNNING] * 2 + [RequestStatus.WAITING] * 2
    out = scheduler.schedule()  # prefill still has priority over decode
    assert ids(out.prefill) == ["r2", "r3"]
    assert (r2.block_table, r3.block_table) == ([4, 5], [6])
    assert ids(scheduler.running) == ["r0", "r1", "r2", "r3"] and scheduler.pool.num_free == 25


def test_head_longer_than_the_budget_is_admitted_alone() -> None:
    """The first request of a batch is admitted even when it alone exceeds the budget."""
    scheduler = make_scheduler(prefill_token_budget=4)
    big, small = make_request("big", 10), make_request("small", 1)
    scheduler.add(big)
    scheduler.add(small)
    assert ids(scheduler.schedule().prefill) == ["big"]
    assert big.block_table == [0, 1, 2]
    assert ids(scheduler.schedule().prefill) == ["small"] and small.block_table == [3]


def test_batch_size_cap_and_max_running() -> None:
    """At most prefill_batch_size per prefill step and max_running in the running set."""
    scheduler = make_scheduler(max_running=3, prefill_batch_size=2)
    requests = create_requests(4, 3)
    for r in requests:
        scheduler.add(r)
    assert ids(scheduler.schedule().prefill) == ["r0", "r1"]
    assert ids(scheduler.schedule().prefill) == ["r2"]  # running is full at 3
    grow(requests[:3])
    out = scheduler.schedule()
    assert out.prefill == [] and ids(out.decode) == ["r0", "r1", "r2"]
    assert ids(list(scheduler.waiting)) == ["r3"]
    scheduler.finish(requests[1], RequestStatus.FINISHED_STOPPED)
    assert ids(scheduler.schedule().prefill) == ["r3"] and requests[3].block_table == [3]  # 1 is at the tail


def test_admission_stops_at_the_first_request_without_pages() -> None:
    """Admission is strictly FCFS on pages too: a fitting request behind a blocked head waits."""
    scheduler = make_scheduler(num_pages=4)
    r0, r1, r2 = make_request("r0", 10), make_request("r1", 5), make_request("r2", 1)
    for r in (r0, r1, r2):
        scheduler.add(r)
    assert ids(scheduler.schedule().prefill) == ["r0"]  # r1 needs 2 pages, 1 is free
    assert r0.block_table == [0, 1, 2] and ids(list(scheduler.waiting)) == ["r1", "r2"]
    out = scheduler.schedule()
    assert ids(out.decode) == ["r0"] and r2.block_table == []


def test_decode_allocates_a_page_only_at_a_page_boundary() -> None:
    """A decode step adds a page only when num_tokens crosses a multiple of page_size."""
    scheduler = make_scheduler(num_pages=8)
    full, partial = make_request("full", 4), make_request("partial", 5)
    scheduler.add(full)
    scheduler.add(partial)
    scheduler.schedule()
    assert (full.block_table, partial.block_table) == ([0], [1, 2])
    grow([full, partial])  # 5 and 6 tokens
    out = scheduler.schedule()
    assert ids(out.decode) == ["full", "partial"]
    assert (full.block_table, partial.block_table) == ([0, 3], [1, 2])
    grow([full, partial], token=8)  # 6 and 7 tokens: no new page
    scheduler.schedule()
    assert (full.block_table, partial.block_table) == ([0, 3], [1, 2]) and scheduler.pool.num_free == 4


def test_freed_pages_are_reused_from_the_tail_of_the_free_list() -> None:
    """finish frees pages to the tail: the next allocation takes older free pages first."""
    scheduler = make_scheduler(num_pages=6)
    r0, r1, r2 = make_request("r0", 8), make_request("r1", 8), make_request("r2", 4)
    for r in (r0, r1, r2):
        scheduler.add(r)
    scheduler.schedule()
    assert (r0.block_table, r1.block_table, r2.block_table) == ([0, 1], [2, 3], [4])
    scheduler.finish(r0, RequestStatus.FINISHED_LENGTH)
    assert scheduler.pool.free_page_ids() == [5, 0, 1]
    r3 = make_request("r3", 9)
    scheduler.add(r3)
    assert ids(scheduler.schedule().prefill) == ["r3"] and r3.block_table == [5, 0, 1]
    scheduler.pool.check_integrity()


def test_decode_without_pages_preempts_the_newest_by_recompute() -> None:
    """The newest running request loses its pages, is PREEMPTED and goes to the head of waiting."""
    scheduler = make_scheduler(num_pages=4)
    r0, r1, r2 = make_request("r0", 4), make_request("r1", 4), make_request("r2", 8)
    for r in (r0, r1, r2):
        scheduler.add(r)
    assert ids(scheduler.schedule().prefill) == ["r0", "r1", "r2"]
    assert (r0.block_table, r1.block_table, r2.block_table) == ([0], [1], [2, 3])
    late = make_request("late", 4)
    scheduler.add(late)  # cannot be admitted: no free page
    grow([r0, r1, r2])
    out = scheduler.schedule()
    assert ids(out.decode) == ["r0", "r1"] and ids(out.preempted) == ["r2"]
    assert (r0.block_table, r1.block_table) == ([0, 2], [1, 3])
    assert r2.block_table == [] and r2.status is RequestStatus.PREEMPTED
    assert r2.num_preemptions == 1 and scheduler.num_preemptions == 1
    assert ids(list(scheduler.waiting)) == ["r2", "late"] and ids(scheduler.running) == ["r0", "r1"]
    assert scheduler.pool.num_free == 0
    scheduler.pool.check_integrity()


def test_preempted_request_is_recomputed_with_prompt_plus_outputs() -> None:
    """The recompute prefill covers num_tokens (prompt + outputs) in pages and in the token budget."""
    scheduler = make_scheduler(num_pages=4, prefill_token_budget=12)
    r0, r1, r2 = make_request("r0", 4), make_request("r1", 4), make_request("r2", 8)
    for r in (r0, r1, r2):
        scheduler.add(r)
    scheduler.schedule()
    late = make_request("late", 4)
    scheduler.add(late)
    grow([r0, r1, r2])
    scheduler.schedule()  # preempts r2
    scheduler.finish(r0, RequestStatus.FINISHED_STOPPED)
    scheduler.finish(r1, RequestStatus.FINISHED_STOPPED)
    assert scheduler.pool.free_page_ids() == [0, 2, 1, 3]
    out = scheduler.schedule()
    assert ids(out.prefill) == ["r2"]  # 9 + 4 tokens > budget 12: late waits
    assert r2.num_tokens == 9 and r2.all_token_ids == [*range(10, 18), 7]
    assert r2.block_table == [0, 2, 1] and r2.status is RequestStatus.RUNNING
    assert ids(scheduler.schedule().prefill) == ["late"] and late.block_table == [3]


def test_a_request_that_is_the_newest_preempts_itself() -> None:
    """When the request lacking a page is itself the newest, it is the one preempted."""
    scheduler = make_scheduler(num_pages=2)
    old, new = make_request("old", 4), make_request("new", 4)
    scheduler.add(old)
    scheduler.add(new)
    scheduler.schedule()
    grow([new])  # old needs no page (4 tokens), new needs a second one
    out = scheduler.schedule()
    assert ids(out.decode) == ["old"] and ids(out.preempted) == ["new"]
    assert old.block_table == [0] and scheduler.pool.free_page_ids() == [1]
    assert ids(list(scheduler.waiting)) == ["new"] and new.num_preemptions == 1


def test_preemption_repeats_until_the_rest_fits() -> None:
    """Several newest requests are preempted in turn, newest first, until the oldest fit."""
    scheduler = make_scheduler(num_pages=3)
    reqs = create_requests(3, 4)
    for r in reqs:
        scheduler.add(r)
    scheduler.schedule()
    grow(reqs)  # each needs a second page; only one can have it
    out = scheduler.schedule()
    assert ids(out.preempted) == ["r2", "r1"] and ids(out.decode) == ["r0"]
    assert reqs[0].block_table == [0, 2] and scheduler.pool.free_page_ids() == [1]
    assert ids(list(scheduler.waiting)) == ["r1", "r2"]  # each went to the head in turn
    assert scheduler.num_preemptions == 2


def test_finish_frees_pages_and_removes_from_either_queue() -> None:
    """finish drops a running or a waiting request, frees its pages and sets its status."""
    scheduler = make_scheduler(num_pages=4, max_running=1)
    running, waiting = make_request("a", 5), make_request("b", 3)
    scheduler.add(running)
    scheduler.add(waiting)
    scheduler.schedule()
    assert running.block_table == [0, 1] and scheduler.num_unfinished == 2
    scheduler.finish(waiting, RequestStatus.FINISHED_ABORTED)
    assert list(scheduler.waiting) == [] and waiting.status is RequestStatus.FINISHED_ABORTED
    scheduler.finish(running, RequestStatus.FINISHED_LENGTH)
    assert scheduler.running == [] and running.block_table == [] and running.finish_reason == "length"
    assert scheduler.pool.free_page_ids() == [2, 3, 0, 1] and scheduler.num_unfinished == 0
    assert scheduler.schedule().empty


def test_can_admit_and_add_running() -> None:
    """can_admit needs a running slot and the pages; an adopted request is decoded as the newest."""
    pool = PagePool(4)
    scheduler = ContinuousBatchingScheduler(pool, 4, max_running=2, prefill_token_budget=64, prefill_batch_size=8)
    assert scheduler.can_admit(4) and not scheduler.can_admit(5)
    adopted = make_request("h0", 6, outputs=[42])
    adopted.block_table = pool.allocate(2)
    scheduler.add_running(adopted)
    assert adopted.status is RequestStatus.RUNNING and scheduler.can_admit(2) and not scheduler.can_admit(3)
    other = make_request("h1", 3, outputs=[43])
    other.block_table = pool.allocate(1)
    scheduler.add_running(other)
    assert not scheduler.can_admit(0)  # max_running reached
    out = scheduler.schedule()  # h0 has 7 tokens in 2 pages, h1 4 tokens in 1: no page needed
    assert ids(out.decode) == ["h0", "h1"] and pool.free_page_ids() == [3]
    grow([adopted, other])  # h0: 8 tokens (2 pages), h1: 5 tokens (needs a second page)
    out = scheduler.schedule()
    assert other.block_table == [2, 3] and out.preempted == []
