"""Mixed steps (chunked prefill fused with decode): the token budget, chunk sizes and order, and
what a request whose prefill is under way keeps when it is preempted or aborted."""

from __future__ import annotations

from mm_serve.runtime.request import Request, RequestStatus
from mm_serve.text_decode.scheduler import ContinuousBatchingScheduler, SchedulerOutput
from tests.policy.factories import create_requests, make_request, make_scheduler


def ids(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


def ends(requests: list[Request]) -> list[int]:
    return [r.prefill_end for r in requests]


def run(scheduler: ContinuousBatchingScheduler, out: SchedulerOutput, token: int = 7) -> None:
    """What the engine does after a mixed step's pass: commit the computed KV, advance the chunks,
    and give a token to each request whose prefill finished and to each decoded one."""
    if scheduler.prefix is not None:
        for request in out.prefill:
            scheduler.prefix.commit(request, request.prefill_end or request.num_tokens)
    done = [r for r in out.prefill if r.prefill_done]
    scheduler.chunk_done(out.prefill)
    for request in done + out.decode:
        request.append_output(token, None)


def test_decode_tokens_come_first_then_chunks_fill_the_budget() -> None:
    """Budget 16: two 10-token prompts take 10 + 6; next step one decode token, the other's last
    4 tokens and a 3-token newcomer; then three decodes and no prefill."""
    scheduler = make_scheduler(num_pages=16, mixed_step_tokens=16)
    r0, r1 = create_requests(2, 10)
    r2 = make_request("r2", 3)
    for r in (r0, r1, r2):
        scheduler.add(r)
    out = scheduler.schedule()
    assert ids(out.prefill) == ["r0", "r1"] and out.decode == [] and ends(out.prefill) == [0, 6]
    assert (r0.block_table, r1.block_table) == ([0, 1, 2], [3, 4, 5])  # pages for the whole prompt at once
    assert ids(scheduler.prefilling) == ["r1"] and ids(list(scheduler.waiting)) == ["r2"]
    run(scheduler, out)
    assert (r0.num_tokens, r1.num_tokens, r1.num_cached_tokens, r1.prefill_end) == (11, 10, 6, 0)
    out = scheduler.schedule()
    assert ids(out.decode) == ["r0"] and ids(out.prefill) == ["r1", "r2"] and ends(out.prefill) == [0, 0]
    assert r2.block_table == [6] and ids(scheduler.prefilling) == ["r1"]  # until its last chunk ran
    run(scheduler, out)
    assert scheduler.prefilling == []
    out = scheduler.schedule()
    assert ids(out.decode) == ["r0", "r1", "r2"] and out.prefill == []
    assert (r0.num_tokens, r1.num_tokens) == (12, 11) and (r0.block_table, r1.block_table) == ([0, 1, 2], [3, 4, 5])
    run(scheduler, out)
    scheduler.schedule()
    assert r0.block_table == [0, 1, 2, 7] and r1.block_table == [3, 4, 5]  # r0's 13th token opens a page


def test_a_long_prompt_runs_in_budget_sized_chunks_beside_every_decode() -> None:
    """Budget 9 with four decoding requests: a 22-token prompt runs in chunks of 5, 5, 5, 5 and 2,
    and every step decodes all four."""
    scheduler = make_scheduler(num_pages=32, mixed_step_tokens=9)
    decoding = create_requests(4, 1)
    for r in decoding:
        scheduler.add(r)
    run(scheduler, scheduler.schedule())  # the four 1-token prompts are admitted whole
    long = make_request("long", 22)
    scheduler.add(long)
    chunk_ends, cached = [], []
    for _ in range(5):
        out = scheduler.schedule()
        assert ids(out.decode) == ["r0", "r1", "r2", "r3"] and ids(out.prefill) == ["long"]
        chunk_ends.append(long.prefill_end)
        run(scheduler, out)
        cached.append(long.num_cached_tokens)
    assert chunk_ends == [5, 10, 15, 20, 0] and cached == [5, 10, 15, 20, 20]
    assert long.output_token_ids == [7] and [len(r.output_token_ids) for r in decoding] == [6] * 4
    out = scheduler.schedule()
    assert ids(out.decode) == ["r0", "r1", "r2", "r3", "long"] and out.prefill == []


def test_decodes_that_fill_the_budget_leave_one_page_of_prefill() -> None:
    """Budget 3 with three decoding requests (page size 4): each step still prefills 4 tokens, so a
    10-token prompt arrives in chunks of 4, 4 and 2 instead of waiting for the decodes to end."""
    scheduler = make_scheduler(num_pages=32, mixed_step_tokens=3)
    first = create_requests(3, 1)
    for r in first:
        scheduler.add(r)
    run(scheduler, scheduler.schedule())
    late = make_request("late", 10)
    scheduler.add(late)
    chunk_ends = []
    for _ in range(3):
        out = scheduler.schedule()
        assert ids(out.decode) == ["r0", "r1", "r2"] and ids(out.prefill) == ["late"]
        chunk_ends.append(late.prefill_end)
        run(scheduler, out)
    assert chunk_ends == [4, 8, 0] and late.output_token_ids == [7]


def test_the_batch_size_cap_counts_continuing_chunks() -> None:
    """prefill_batch_size 2: a continuing chunk and one newcomer; the third request waits."""
    scheduler = make_scheduler(num_pages=32, mixed_step_tokens=12, prefill_batch_size=2)
    big = make_request("big", 16)
    scheduler.add(big)
    run(scheduler, scheduler.schedule())
    assert big.num_cached_tokens == 12
    a, b = make_request("a", 2), make_request("b", 2)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert ids(out.prefill) == ["big", "a"] and ends(out.prefill) == [0, 0]
    assert ids(list(scheduler.waiting)) == ["b"]


def test_a_recompute_preempted_mid_prefill_registers_only_its_computed_pages() -> None:
    """A preempted request (prompt + outputs) is recomputed in chunks; preempted again after its
    first chunk, only the page that chunk filled is registered in the prefix cache (its other
    pages hold no KV of its tokens) and it goes back to waiting with no chunk set."""
    scheduler = make_scheduler(num_pages=4, mixed_step_tokens=8, prefix_caching=True)
    old = make_request("old", 4)
    recompute = make_request("again", 9, outputs=[7, 7, 7], first_id=50)  # 12 tokens: 3 pages
    scheduler.add(old)
    scheduler.add(recompute)
    out = scheduler.schedule()
    assert ids(out.prefill) == ["old", "again"] and ends(out.prefill) == [0, 4]  # 4 + 4 tokens
    assert (old.block_table, recompute.block_table) == ([0], [1, 2, 3])
    run(scheduler, out)
    pool = scheduler.pool
    assert recompute.num_cached_tokens == 4 and [pool.hash_of(p) is not None for p in (1, 2, 3)] == [True, False, False]
    out = scheduler.schedule()  # old's 5th token needs a page: the newest, mid-prefill, is preempted
    assert ids(out.preempted) == ["again"] and ids(out.decode) == ["old"] and out.prefill == []
    assert recompute.status is RequestStatus.PREEMPTED and recompute.prefill_end == 0
    assert scheduler.prefilling == [] and ids(list(scheduler.waiting)) == ["again"]
    assert [pool.hash_of(p) is not None for p in (1, 2, 3)] == [True, False, False]
    pool.check_integrity()


def test_abort_mid_prefill_frees_the_pages_and_forgets_the_chunk() -> None:
    """finish on a request whose prefill is under way frees all its pages and drops it from prefilling."""
    scheduler = make_scheduler(num_pages=8, mixed_step_tokens=9)
    long = make_request("long", 20)
    scheduler.add(long)
    out = scheduler.schedule()
    assert ends(out.prefill) == [9] and long.block_table == [0, 1, 2, 3, 4]
    run(scheduler, out)
    scheduler.finish(long, RequestStatus.FINISHED_ABORTED)
    assert scheduler.prefilling == [] and scheduler.running == [] and long.block_table == []
    assert scheduler.pool.num_free == 8 and scheduler.schedule().empty


def test_preempting_an_earlier_lower_tier_request_skips_no_one() -> None:
    """A batch-tier request admitted first, an interactive one after: when the interactive one needs a
    page, the earlier batch-tier request is preempted and the interactive one still gets its page
    (it used to be skipped, and its decode step read past its block table)."""
    for mixed in (0, 64):
        scheduler = make_scheduler(num_pages=4, mixed_step_tokens=mixed)
        low = make_request("low", 8, priority=2)
        scheduler.add(low)
        run(scheduler, scheduler.schedule())  # low: 9 tokens
        high = make_request("high", 4, priority=0)
        scheduler.add(high)
        out = scheduler.schedule()
        assert ids(out.prefill) == ["high"] and len(high.block_table) == 1
        run(scheduler, out)  # high: 5 tokens, needs a second page; low (older, lower tier) holds the rest
        out = scheduler.schedule()
        assert ids(out.preempted) == ["low"] and ids(out.decode) == ["high"] and len(high.block_table) == 2
        scheduler.pool.check_integrity()


def test_displacement_recounts_pages_a_displaced_request_shared() -> None:
    """An interactive prompt sharing its first pages with a running batch-tier request displaces it;
    those pages are free-but-cached afterwards and the admission counts them again instead of
    running the pool dry (it raised PagePoolExhaustedError)."""
    scheduler = make_scheduler(num_pages=6, prefix_caching=True)
    y = make_request("y", 12, priority=2, first_id=100, max_tokens=2)
    x = make_request("x", 11, priority=2, max_tokens=2)
    for request in (y, x):
        scheduler.add(request)
        run(scheduler, scheduler.schedule())
    assert scheduler.pool.num_free == 0
    h = make_request("h", 17, priority=0, max_tokens=2)  # its first 8 tokens are x's first 2 pages
    scheduler.add(h)
    out = scheduler.schedule()
    assert ids(out.prefill) == ["h"] and h.num_cached_tokens == 8 and len(h.block_table) == 5
    assert ids(scheduler.running) == ["h"] and [r.status for r in (x, y)] == [RequestStatus.PREEMPTED] * 2
    scheduler.pool.check_integrity()
