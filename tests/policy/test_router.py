"""Router: least-queued prefill, decode room accounting with in-flight pages, stats, fallback."""

from __future__ import annotations

import pytest

from mm_serve.engine.load_view import ARRIVAL_WINDOW_S
from mm_serve.engine.prefix_index import PrefixIndex
from tests.policy.factories import Books, make_router


def free_pages(router: Books) -> list[int]:
    return [load.free_after_inflight() for load in router.decode]


def test_pick_prefill_is_the_fewest_queued_tokens_lowest_index_on_ties() -> None:
    """Prefill goes to the worker with the fewest queued tokens; ties go to the lowest index."""
    router = make_router(num_prefill=3, num_decode=1)
    assert router.pick_prefill() == 0
    router.dispatched("a", prefill=0, decode=0, tokens=100, pages=1)
    assert router.pick_prefill() == 1
    router.dispatched("b", prefill=1, decode=0, tokens=50, pages=1)
    assert router.pick_prefill() == 2
    router.dispatched("c", prefill=2, decode=0, tokens=50, pages=1)
    assert router.prefill_tokens == [100, 50, 50]
    assert router.pick_prefill() == 1  # 1 and 2 tie at 50


def test_a_slower_prefill_worker_gets_work_in_proportion_to_its_speed() -> None:
    """Queued work (plus the request's own) is weighed by each worker's speed: a worker twice
    as slow is picked only while its queue is under half of the fast one's."""
    router = make_router(num_prefill=2, num_decode=1)
    router.set_prefill_speed(1, 2.0)
    assert router.pick_prefill(tokens=100) == 0  # both idle: the fast one finishes first
    router.dispatched("a", prefill=0, decode=0, tokens=100, pages=1)
    assert router.pick_prefill(tokens=100) == 0  # (100 + 100) x 1 = 200 vs 100 x 2 = 200: the lower index
    router.dispatched("b", prefill=0, decode=0, tokens=60, pages=1)
    assert router.pick_prefill(tokens=100) == 1  # 260 vs 200
    router.dispatched("c", prefill=1, decode=0, tokens=100, pages=1)
    assert router.pick_prefill(tokens=100) == 0  # 260 vs 400
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        router.set_prefill_speed(1, bad)  # ignored
    assert router.prefill_speed == [1.0, 2.0]
    router.set_prefill_speed(1, 0.5)
    assert router.pick_prefill(tokens=100) == 1  # 260 vs 100


def test_the_load_view_is_of_the_worker_that_would_finish_the_request_first() -> None:
    router = make_router(num_prefill=2, num_decode=1)
    router.dispatched("a", prefill=0, decode=0, tokens=300, pages=1)
    router.set_prefill_speed(1, 4.0)
    assert router.view(0, 1, [0, 1], [0], tokens=50).prefill == 1  # 350 vs 50 x 4 = 200
    assert router.view(0, 1, [0, 1], [0], tokens=200).prefill == 0  # a long prompt: 500 vs 800
    assert router.view(0, 1, [1], [0], tokens=200).prefill == 1  # only the candidates


def test_prefilled_releases_the_queued_tokens_once() -> None:
    """The first token back releases the request's queued tokens exactly once."""
    router = make_router(num_prefill=2, num_decode=1)
    router.dispatched("a", prefill=0, decode=0, tokens=100, pages=1)
    router.dispatched("b", prefill=1, decode=0, tokens=30, pages=1)
    router.dispatched("c", prefill=1, decode=0, tokens=30, pages=1)
    assert router.prefill_tokens == [100, 60] and router.pick_prefill() == 1
    router.prefilled("a")
    assert router.prefill_tokens == [0, 60] and router.prefill_of("a") is None
    router.prefilled("a")  # every later update of the request says so again
    router.prefilled("unknown")
    assert router.prefill_tokens == [0, 60] and router.pick_prefill() == 0
    assert router.prefill_of("b") == 1 and router.decode_of("a") == 0  # still decoding


def test_pick_decode_counts_in_flight_pages_until_claimed() -> None:
    """Dispatched pages count against a decode worker until claimed; after that its stats do."""
    router = make_router(num_prefill=1, num_decode=2, decode_pages_total=100)
    assert router.pick_decode(10) == 0  # equal room: the lowest index
    router.dispatched("a", prefill=0, decode=0, tokens=8, pages=30)
    assert free_pages(router) == [70, 100] and router.pick_decode(10) == 1
    router.dispatched("b", prefill=0, decode=1, tokens=8, pages=40)
    assert free_pages(router) == [70, 60] and router.pick_decode(10) == 0
    router.claimed("a")
    assert router.decode[0].inflight == {} and free_pages(router) == [100, 60]
    router.update_decode_stats(0, pages_used=30, pages_total=100, running=1)
    assert free_pages(router) == [70, 60] and router.decode[0].running == 1
    router.claimed("a")  # repeated on every decode update: no effect
    assert free_pages(router) == [70, 60] and router.decode_of("a") == 0


def test_finished_forgets_the_request_everywhere() -> None:
    """finished releases the prefill tokens and the in-flight pages and forgets both routes."""
    router = make_router(num_prefill=2, num_decode=2, decode_pages_total=50)
    router.dispatched("a", prefill=1, decode=1, tokens=12, pages=5)
    assert (router.prefill_of("a"), router.decode_of("a")) == (1, 1)
    assert router.prefill_tokens == [0, 12] and router.decode[1].inflight == {"a": 5}
    router.finished("a")
    assert (router.prefill_of("a"), router.decode_of("a")) == (None, None)
    assert router.prefill_tokens == [0, 0] and free_pages(router) == [50, 50]
    router.finished("a")
    assert router.prefill_tokens == [0, 0]


def test_max_running_counts_stats_and_in_flight_requests() -> None:
    """A worker at max_running (reported running plus in flight) has no room, whatever its pages."""
    router = make_router(num_prefill=1, num_decode=2, decode_pages_total=100, max_running=2)
    router.update_decode_stats(0, pages_used=10, pages_total=100, running=2)
    router.update_decode_stats(1, pages_used=90, pages_total=100, running=0)
    assert router.pick_decode(5) == 1  # 0 has 90 free pages but is full
    router.dispatched("x", prefill=0, decode=1, tokens=4, pages=2)
    assert router.pick_decode(5) == 1  # 1 running + in flight = 1 < 2
    router.dispatched("y", prefill=0, decode=1, tokens=4, pages=2)
    assert free_pages(router) == [90, 6]
    assert router.pick_decode(5) == 0  # neither has room: the one with the most free pages
    router.claimed("x")
    assert router.pick_decode(5) == 1  # room again (its stats do not count x yet)


def test_a_worker_with_room_beats_one_with_more_free_pages_but_too_few() -> None:
    """Fit comes first: pages_needed must fit; among fitting workers the most free pages wins."""
    router = make_router(num_prefill=1, num_decode=3, decode_pages_total=100, max_running=4)
    router.update_decode_stats(0, pages_used=80, pages_total=100, running=0)
    router.update_decode_stats(1, pages_used=60, pages_total=100, running=3)
    router.update_decode_stats(2, pages_used=70, pages_total=100, running=0)
    assert free_pages(router) == [20, 40, 30]
    assert router.pick_decode(10) == 1
    assert router.pick_decode(35) == 1
    assert router.pick_decode(41) == 1  # nothing fits: the most free pages
    router.update_decode_stats(1, pages_used=60, pages_total=100, running=4)
    assert router.pick_decode(25) == 2  # 1 is full, 2 has more room than 0


def test_without_room_the_least_loaded_is_picked() -> None:
    """When no worker fits, the most free pages wins, then the fewest busy requests."""
    router = make_router(num_prefill=1, num_decode=3, decode_pages_total=64, max_running=8)
    router.update_decode_stats(0, pages_used=54, pages_total=64, running=3)
    router.update_decode_stats(1, pages_used=54, pages_total=64, running=1)
    router.update_decode_stats(2, pages_used=60, pages_total=64, running=0)
    assert router.pick_decode(20) == 1  # 0 and 1 both have 10 free; 1 is less busy
    router.dispatched("z", prefill=0, decode=1, tokens=4, pages=1)
    assert router.pick_decode(20) == 0  # 1 now has 9 free


def test_update_decode_stats_replaces_the_pool_size() -> None:
    """Stats update pages_used, pages_total and running; in-flight pages stay counted."""
    router = make_router(num_prefill=1, num_decode=2, decode_pages_total=100)
    router.dispatched("a", prefill=0, decode=0, tokens=4, pages=20)
    router.update_decode_stats(0, pages_used=5, pages_total=200, running=1)
    load = router.decode[0]
    assert (load.pages_used, load.pages_total, load.running) == (5, 200, 1)
    assert free_pages(router) == [175, 100] and router.pick_decode(1) == 0


def test_cache_aware_routing_prefers_the_worker_holding_the_prefix() -> None:
    router = make_router(num_prefill=3, cache_aware=True, balance_tokens=100)
    chain = [b"p0", b"p1", b"p2"]
    router.dispatched("a", prefill=2, decode=0, tokens=50, pages=4, page_hashes=chain)
    router.prefilled("a")
    assert router.pick_prefill(page_hashes=chain) == 2  # holds all three pages
    assert router.pick_prefill(page_hashes=[b"x"] + chain) == 0  # no prefix match: least queued
    assert router.pick_prefill() == 0


def test_cache_aware_routing_yields_to_load_past_the_balance_margin() -> None:
    router = make_router(num_prefill=2, cache_aware=True, balance_tokens=100)
    chain = [b"p0", b"p1"]
    router.dispatched("warm", prefill=1, decode=0, tokens=9, pages=3, page_hashes=chain)
    router.prefilled("warm")
    router.dispatched("a", prefill=1, decode=0, tokens=100, pages=25)
    assert router.pick_prefill(page_hashes=chain) == 1  # 100 queued tokens more: within the margin
    router.dispatched("b", prefill=1, decode=0, tokens=1, pages=1)
    assert router.pick_prefill(page_hashes=chain) == 0  # 101 more: the idle worker wins
    router.reset_prefill(1)
    router.prefilled("a")
    router.prefilled("b")
    assert router.pick_prefill(page_hashes=chain) == 0  # a restarted worker holds nothing


def test_a_dispatched_prefix_hit_counts_only_the_tokens_left_to_compute() -> None:
    router = make_router(num_prefill=2, cache_aware=True)
    chain = [b"p0", b"p1", b"p2"]
    router.dispatched("a", prefill=0, decode=0, tokens=14, pages=4, page_hashes=chain)
    assert router.prefill_tokens == [14, 0]  # nothing was cached yet
    router.prefilled("a")
    router.dispatched("b", prefill=0, decode=0, tokens=14, pages=4, page_hashes=chain)
    assert router.prefill_tokens == [2, 0] and router.queued() == (1, 2)  # 12 of 14 cached
    router.prefilled("b")
    assert router.prefill_tokens == [0, 0]


def test_least_queued_routing_ignores_prefixes() -> None:
    router = make_router(num_prefill=2, cache_aware=False)
    router.dispatched("a", prefill=1, decode=0, tokens=10, pages=1, page_hashes=[b"p0"])
    router.prefilled("a")
    router.dispatched("b", prefill=0, decode=0, tokens=5, pages=1)
    assert router.pick_prefill(page_hashes=[b"p0"]) == 1  # fewest queued tokens, prefix unknown


def test_prefix_index_forgets_the_oldest_pages_past_its_capacity() -> None:
    index = PrefixIndex(num_workers=1, capacity=3)
    index.record(0, [b"a", b"b", b"c"])
    index.record(0, [b"d"])
    assert index.size(0) == 3 and index.match(0, [b"a"]) == 0 and index.match(0, [b"b", b"c", b"d"]) == 3


def test_an_image_sent_to_a_worker_lately_is_not_counted_as_an_image_to_encode_there() -> None:
    """40 calls repeating one image are encoded once per prefill worker (its encoder cache): the
    work queued there counts that image once, a request repeating an image counts it once, and
    a restarted worker (its cache gone) or one past the cache's size encodes again."""
    router = make_router(num_prefill=2, encoder_images=2)
    for i in range(40):
        router.dispatched(f"r{i}", prefill=0, decode=0, tokens=80, pages=6, images=1, image_hashes=[b"img"])
    assert router.prefill[0].by_tier[1].images == 1 and router.prefill[0].by_tier[1].requests == 40
    assert router.images_to_encode(0, [b"img", b"new", b"new"]) == [False, True, False]
    assert router.images_to_encode(1, [b"img"]) == [True]  # the other worker never saw it
    router.dispatched("s", prefill=0, decode=0, tokens=80, pages=6, images=2, image_hashes=[b"x", b"y"])
    assert router.images_to_encode(0, [b"img"]) == [True]  # past the 2 images its cache holds
    router.reset_prefill(0)
    assert router.images_to_encode(0, [b"x"]) == [True]
    plain = make_router(num_prefill=1)  # no encoder cache: every image is encoded
    plain.dispatched("a", prefill=0, decode=0, tokens=80, pages=6, images=1, image_hashes=[b"img"])
    plain.dispatched("b", prefill=0, decode=0, tokens=80, pages=6, images=1, image_hashes=[b"img"])
    assert plain.prefill[0].by_tier[1].images == 2 and plain.images_to_encode(0, [b"img"]) == [True]


def test_tiled_images_are_counted_in_tower_passes_and_a_cached_one_counts_none() -> None:
    """A LLaVA-NeXT image at full detail is 5 tower passes (its whole-image tile and a 2x2 grid), at
    low detail 1: the queued work counts passes, and an image in the worker's encoder cache none."""
    router = make_router(num_prefill=1, encoder_images=4)
    router.dispatched("a", prefill=0, decode=0, tokens=120, pages=8, images=2, image_hashes=[b"big", b"low"],
                      tiles=[5, 1])
    assert router.prefill[0].by_tier[1].images == 6
    router.dispatched("b", prefill=0, decode=0, tokens=120, pages=8, images=2, image_hashes=[b"big", b"new"],
                      tiles=[5, 3])
    assert router.prefill[0].by_tier[1].images == 6 + 3  # "big" is held there: only the new one's 3
    plain = make_router(num_prefill=1)  # no encoder cache: every tile is encoded
    plain.dispatched("c", prefill=0, decode=0, tokens=80, pages=6, images=1, image_hashes=[b"big"], tiles=[5])
    assert plain.prefill[0].by_tier[1].images == 5


def test_the_load_view_picks_the_prefix_holder_and_counts_its_cached_pages() -> None:
    router = make_router(num_prefill=2, cache_aware=True)
    router.dispatched("a", prefill=1, decode=0, tokens=40, pages=3, page_hashes=[b"p0", b"p1"])
    router.prefilled("a")
    view = router.view(1, 3, [0, 1], [0, 1], page_hashes=[b"p0", b"p1", b"p2"])
    assert (view.prefill, view.cached_pages) == (1, 2)
    assert router.view(1, 3, [0, 1], [0, 1]).cached_pages == 0  # no hashes: nothing known cached


def test_the_load_view_names_the_tightest_tier_live_on_the_decode_worker() -> None:
    """Each decode worker counts its live requests per tier rank until they finish; dispatching an
    id again forgets its first dispatch (tokens, pages, rank); the view reports the tightest rank."""
    router = make_router(num_prefill=1, num_decode=2, decode_pages_total=50)
    router.dispatched("s", prefill=0, decode=0, tokens=8, pages=1, rank=1)
    router.dispatched("i", prefill=0, decode=0, tokens=8, pages=1, rank=0)
    assert router.view(2, 1, [0], [0]).decode_tightest == 0
    router.prefilled("i")
    router.claimed("i")  # still decoding there: it still counts
    assert router.decode[0].tightest() == 0
    router.dispatched("i", prefill=0, decode=1, tokens=8, pages=1, rank=0)  # the same id again, to decode 1
    assert router.decode[0].by_tier == [0, 1, 0] and router.decode[1].by_tier == [1, 0, 0]
    assert router.queued() == (2, 16) and router.decode[0].inflight == {"s": 1}
    router.finished("i")
    router.finished("i")  # twice: counted once
    assert router.decode[1].tightest() is None and router.view(2, 1, [0], [0]).decode_tightest == 1
    router.finished("s")
    assert [load.by_tier for load in router.decode] == [[0, 0, 0], [0, 0, 0]]


def test_looser_requests_past_their_max_wait_count_ahead_in_the_view() -> None:
    """The prefill scheduler serves a looser request that waited past its max_wait_s as rank 0,
    so from then on the view counts it ahead of a new interactive request, not behind it."""
    router = make_router(num_prefill=1, num_decode=1)
    router.dispatched("batch", prefill=0, decode=0, tokens=300, pages=1, rank=2, images=1, max_wait_s=60.0, now=100.0)
    router.dispatched("std", prefill=0, decode=0, tokens=50, pages=1, rank=1, max_wait_s=2.0, now=100.0)
    router.dispatched("never", prefill=0, decode=0, tokens=7, pages=1, rank=2, now=100.0)  # no max_wait: never ages
    fresh = router.view(0, 1, [0], [0], now=101.0)
    assert (fresh.ahead.requests, fresh.ahead.tokens) == (0, 0)
    assert (fresh.looser.requests, fresh.looser.tokens, fresh.looser.images) == (3, 357, 1)
    aged = router.view(0, 1, [0], [0], now=102.5)  # "std" waited 2.5 s > 2 s
    assert (aged.ahead.requests, aged.ahead.tokens) == (1, 50) and aged.looser.tokens == 307
    late = router.view(1, 1, [0], [0], now=200.0)  # for a standard request: "std" is its own rank anyway
    assert (late.ahead.requests, late.ahead.tokens, late.ahead.images) == (2, 350, 1) and late.looser.tokens == 7
    router.prefilled("batch")
    assert router.view(0, 1, [0], [0], now=200.0).ahead.tokens == 50
    router.dispatched("std", prefill=0, decode=0, tokens=50, pages=1, rank=1, max_wait_s=2.0, now=300.0)  # again
    assert router.view(0, 1, [0], [0], now=301.0).ahead.tokens == 0  # its wait starts over with the new dispatch
    for request_id in ("std", "never"):
        router.finished(request_id)
    assert router.queued() == (0, 0) and router.prefill[0].by_tier == [type(router.prefill[0].by_tier[0])()] * 3


def test_a_reported_batch_in_progress_leaves_the_queue_and_counts_as_running() -> None:
    """Once the prefill worker reports a batch started, the view moves its requests out of
    ``ahead`` and ``looser`` into ``running``, with the seconds since it started; their first
    tokens empty it. A worker that never reported a batch has ``running`` None."""
    router = make_router(num_prefill=2, num_decode=1)
    router.dispatched("i", prefill=0, decode=0, tokens=100, pages=1, rank=0, images=1, now=10.0)
    router.dispatched("b", prefill=0, decode=0, tokens=40, pages=1, rank=2, now=10.0)
    router.dispatched("s", prefill=0, decode=0, tokens=60, pages=1, rank=1, now=10.2)
    assert router.view(1, 1, [0], [0], now=10.3).running is None  # nothing reported yet
    router.batch_started(0, ["i", "b", "gone"], now=10.25)  # an id it does not know is ignored
    view = router.view(1, 1, [0], [0], now=10.35)
    assert view.running is not None and (view.running.requests, view.running.tokens, view.running.images) == (2, 140, 1)
    assert view.running_elapsed_s == pytest.approx(0.1)
    assert (view.ahead.requests, view.ahead.tokens) == (1, 60) and view.looser.requests == 0
    assert router.view(1, 1, [1], [0], now=10.35).running is None  # the other worker reported nothing
    router.prefilled("i")
    router.prefilled("b")
    after = router.view(1, 1, [0], [0], now=10.6)
    assert after.running is not None and after.running.requests == 0 and after.running_elapsed_s == 0.0
    assert (after.ahead.requests, after.ahead.tokens) == (1, 60)


def test_recent_dispatches_to_the_worker_are_counted_over_the_arrival_window() -> None:
    """``LoadView.recent`` is the work dispatched to that prefill worker in the last
    ARRIVAL_WINDOW_S seconds (its arrival rate), whether or not it is still queued."""
    router = make_router(num_prefill=1, num_decode=1)
    router.dispatched("a", prefill=0, decode=0, tokens=100, pages=1, images=1, now=0.0)
    router.dispatched("b", prefill=0, decode=0, tokens=50, pages=1, now=ARRIVAL_WINDOW_S - 1.0)
    router.prefilled("a")
    recent = router.view(1, 1, [0], [0], now=ARRIVAL_WINDOW_S - 0.5).recent
    assert (recent.requests, recent.tokens, recent.images) == (2, 150, 1)
    recent = router.view(1, 1, [0], [0], now=ARRIVAL_WINDOW_S + 0.5).recent  # "a" fell out of the window
    assert (recent.requests, recent.tokens, recent.images) == (1, 50, 0)


def test_queued_looser_requests_are_promises_with_the_work_served_before_them() -> None:
    """``LoadView.promises``: each queued request of a looser rank than the view's, dispatched with
    its arrival time and not aged, with the queued work served before it and itself: tighter
    ranks and aged requests first, then its own rank in dispatch order; the batch in progress
    is not queued work; none on a worker that does not report its batches."""
    router = make_router(num_prefill=1, num_decode=1)
    router.dispatched("s1", prefill=0, decode=0, tokens=100, pages=1, rank=1, now=0.0, arrived_at=-0.2)
    router.dispatched("i1", prefill=0, decode=0, tokens=10, pages=1, rank=0, now=0.1, arrived_at=0.05)
    router.dispatched("s2", prefill=0, decode=0, tokens=200, pages=1, rank=1, images=1, now=0.2, arrived_at=0.15)
    router.dispatched("b1", prefill=0, decode=0, tokens=1000, pages=1, rank=2, now=0.3, arrived_at=0.3)
    router.dispatched("s3", prefill=0, decode=0, tokens=300, pages=1, rank=1, now=0.4, max_wait_s=0.5)
    assert router.view(0, 1, [0], [0], now=0.5).promises == ()  # no batch reported yet (colocated)
    router.batch_started(0, ["s1"], now=0.45)
    promises = {(p.tier, p.arrived_at): p.through for p in router.view(0, 1, [0], [0], now=0.6).promises}
    # s1 prefills now; s3 has no arrival time; i1 is interactive itself
    assert set(promises) == {(1, 0.15), (2, 0.3)}
    assert (promises[(1, 0.15)].requests, promises[(1, 0.15)].tokens, promises[(1, 0.15)].images) == (2, 210, 1)
    # b1 waits for i1, s2 and s3 (all of rank 1 and tighter) and itself
    assert (promises[(2, 0.3)].requests, promises[(2, 0.3)].tokens) == (4, 1510)
    # standard sees only the batch request as looser; at 0.95 s s3 has aged: still before b1, not a promise
    assert [p.tier for p in router.view(1, 1, [0], [0], now=0.95).promises] == [2]
    router.dispatched("s4", prefill=0, decode=0, tokens=40, pages=1, rank=1, now=0.96, arrived_at=0.96)
    after = {p.arrived_at: p.through for p in router.view(0, 1, [0], [0], now=0.97).promises}
    assert after[0.96].tokens == 10 + 300 + 200 + 40  # s3 aged to rank 0: ahead of s2 and s4
    router.prefilled("s2")
    assert 0.15 not in {p.arrived_at for p in router.view(0, 1, [0], [0], now=0.98).promises}

