"""Hand-off sender and receiver over real small shared-memory rings, in one process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from mm_serve.runtime.kv_cache import PagedKVCache
from mm_serve.runtime.lifetime import LifetimeEvent
from mm_serve.runtime.request import Request, RequestStatus
from mm_serve.runtime.sampler import make_generator
from mm_serve.runtime.sampling_params import SamplingParams
from mm_serve.text_decode.handoff_receiver import HandoffReceiver
from mm_serve.text_decode.scheduler import ContinuousBatchingScheduler
from mm_serve.transport.shm_ring import ShmRing
from mm_serve.vision_prefill.handoff_sender import HandoffSender
from tests.policy.factories import (
    FEATURE_DIM,
    PAGE_SIZE,
    RING_PREFIX,
    RING_TAG,
    RingFactory,
    make_kv_cache,
    make_request,
    prefilled_request,
    shm_entries,
)


@pytest.fixture
def rings() -> Iterator[RingFactory]:
    """Creates rings on demand; closes and unlinks them all, and checks /dev/shm is clean."""
    before = shm_entries([RING_PREFIX])
    factory = RingFactory()
    yield factory
    factory.close_all()
    assert shm_entries(factory.names()) == []
    assert [n for n in shm_entries([RING_PREFIX]) if RING_TAG in n] == [n for n in before if RING_TAG in n]


def admit_all(num_pages: int) -> bool:
    return True


def sender_for(ring: ShmRing, cache: PagedKVCache) -> tuple[HandoffSender, list[int]]:
    """A sender over one ring; the list records on_publish calls."""
    rung: list[int] = []
    return HandoffSender([ring], cache, on_publish=rung.append), rung


def test_published_and_claimed_handoff_carries_everything(rings: RingFactory) -> None:
    """Prompt, first token, sampling params, seed and output offset, KV bytes, features and events survive the trip."""
    producer, consumer = rings.create()
    send_cache, recv_cache = make_kv_cache(), make_kv_cache()
    send_cache.pool.allocate(1)
    recv_cache.pool.allocate(3)
    request = prefilled_request(send_cache, "req-0", 6, 42, temperature=0.7, stop_token_ids=(9, 3), logprobs=2,
                                seed=11, max_tokens=20)
    request.output_logprobs = [{42: -0.5, 7: -1.5}]
    request.generator, request.seed, request.output_offset = make_generator(11), 11, 5
    request.image_embeds = torch.arange(3.0 * FEATURE_DIM).view(3, FEATURE_DIM)
    request.num_images = 1
    request.stamp(LifetimeEvent.ARRIVED, 100.0)
    request.stamp(LifetimeEvent.PREFILL_END, 101.0)
    assert request.block_table == [1, 2]
    expected_kv = send_cache.data[[1, 2]].clone()
    sender, rung = sender_for(producer, send_cache)
    sender.add(request)
    assert sender.num_pending == 1 and LifetimeEvent.HANDOFF_BEGIN in request.events
    assert sender.pump() == [request] and rung == [0]
    assert request.block_table == [] and send_cache.pool.num_free == 7 and sender.num_pending == 0
    assert producer.pages_free() == 6 and sender.slots_used() == 1
    head = consumer.peek()
    assert head is not None
    assert (head.request_id, head.page_ids, head.num_kv_tokens, head.first_token) == ("req-0", [0, 1], 6, 42)
    assert (head.feature_offset, head.feature_rows) == (0, 3)

    (claimed,) = HandoffReceiver([consumer], recv_cache).claim_ready(admit_all, set())
    assert claimed.request_id == "req-0" and claimed.prompt_token_ids == list(range(10, 16))
    assert claimed.output_token_ids == [42] and claimed.output_logprobs == [{42: -0.5, 7: -1.5}]
    assert claimed.num_sent_tokens == 1 and claimed.num_images == 1
    assert claimed.sampling_params == SamplingParams(
        max_tokens=20, temperature=0.7, top_p=1.0, top_k=0, seed=11, stop_token_ids=(3, 9), ignore_eos=True,
        logprobs=2,
    )
    assert claimed.block_table == [3, 4] and torch.equal(recv_cache.data[[3, 4]], expected_kv)
    assert claimed.image_embeds is not None and torch.equal(claimed.image_embeds, request.image_embeds)
    assert claimed.generator is not None and (claimed.seed, claimed.output_offset) == (11, 5)
    assert set(claimed.events) == {LifetimeEvent.ARRIVED, LifetimeEvent.PREFILL_END, LifetimeEvent.HANDOFF_BEGIN,
                                   LifetimeEvent.HANDOFF_END}
    assert claimed.events[LifetimeEvent.ARRIVED] == 100.0
    assert claimed.events[LifetimeEvent.HANDOFF_BEGIN] == request.events[LifetimeEvent.HANDOFF_BEGIN]

    assert consumer.peek() is None and sender.slots_used() == 0  # released after the copy
    assert sender.pump() == [] and producer.pages_free() == 8  # reclaimed on the next pump
    assert recv_cache.pool.num_used == 5 and send_cache.pool.num_used == 1
    for pool in (send_cache.pool, recv_cache.pool):
        pool.check_integrity()
    producer.check_integrity()
    assert producer.alloc_features(32) == 0  # every feature row is free again


def test_no_ring_pages_keeps_the_request_pending(rings: RingFactory) -> None:
    """Without ring pages the hand-off stays pending with its local KV; it goes once pages return."""
    producer, consumer = rings.create(num_pages=4)
    send_cache, recv_cache = make_kv_cache(), make_kv_cache()
    first = prefilled_request(send_cache, "a", 16, 40)
    second = prefilled_request(send_cache, "b", 5, 41, fill=0.5)
    expected_kv = send_cache.data[second.block_table].clone()
    sender, rung = sender_for(producer, send_cache)
    sender.add(first)
    sender.add(second)
    assert sender.pump() == [first]
    assert [p.request for p in sender.pending] == [second] and second.block_table == [4, 5]
    assert sender.pending[0].ring_pages is None and producer.pages_free() == 0
    assert sender.pump() == [] and sender.num_pending == 1  # retried, still nothing dropped
    receiver = HandoffReceiver([consumer], recv_cache)
    assert [r.request_id for r in receiver.claim_ready(admit_all, set())] == ["a"]
    assert sender.pump() == [second] and rung == [0, 0]
    head = consumer.peek()
    assert head is not None and head.page_ids == [0, 1]  # a's pages, freed in order
    (claimed,) = receiver.claim_ready(admit_all, set())
    assert claimed.request_id == "b" and claimed.block_table == [5, 6]  # a holds 0-4: 16 tokens + its next one
    assert torch.equal(recv_cache.data[[5, 6]], expected_kv)
    assert send_cache.pool.num_free == 8


def test_no_free_slot_keeps_the_request_pending_with_its_ring_pages(rings: RingFactory) -> None:
    """With every slot taken the hand-off keeps its copied ring pages and publishes them later."""
    producer, consumer = rings.create(capacity=1)
    send_cache, recv_cache = make_kv_cache(), make_kv_cache()
    first, second = prefilled_request(send_cache, "a", 3, 40), prefilled_request(send_cache, "b", 6, 41)
    sender, _ = sender_for(producer, send_cache)
    sender.add(first)
    sender.add(second)
    assert sender.pump() == [first]
    (item,) = sender.pending
    assert (item.ring_pages, item.copied, second.block_table) == ([1, 2], True, [1, 2])
    assert producer.pages_free() == 5
    receiver = HandoffReceiver([consumer], recv_cache)
    assert [r.request_id for r in receiver.claim_ready(admit_all, set())] == ["a"]
    assert sender.pump() == [second] and producer.pages_free() == 6  # a's page reclaimed, b's kept
    head = consumer.peek()
    assert head is not None and (head.request_id, head.page_ids, head.seq) == ("b", [1, 2], 1)


def test_receiver_does_not_claim_without_room(rings: RingFactory) -> None:
    """When can_admit says no the hand-off stays in the ring, and nothing is allocated."""
    producer, consumer = rings.create()
    send_cache, recv_cache = make_kv_cache(), make_kv_cache()
    sender, _ = sender_for(producer, send_cache)
    sender.add(prefilled_request(send_cache, "a", 6, 40))
    sender.pump()
    asked: list[int] = []

    def refuse(num_pages: int) -> bool:
        asked.append(num_pages)
        return False

    receiver = HandoffReceiver([consumer], recv_cache)
    assert receiver.claim_ready(refuse, set()) == []
    assert asked == [2]  # 6 prompt tokens + the first token
    head = consumer.peek()
    assert head is not None and head.request_id == "a" and recv_cache.pool.num_free == 8
    assert producer.slots_used() == 1
    recv_cache.pool.allocate(7)
    scheduler = ContinuousBatchingScheduler(recv_cache.pool, PAGE_SIZE, 4, 64, 8)
    assert receiver.claim_ready(scheduler.can_admit, set()) == []  # 1 free page, 2 needed
    recv_cache.pool.free([0])
    assert [r.block_table for r in receiver.claim_ready(scheduler.can_admit, set())] == [[7, 0]]


@pytest.mark.parametrize("with_ring_allocation", [False, True])
def test_abort_of_a_pending_handoff_frees_both_sides(rings: RingFactory, with_ring_allocation: bool) -> None:
    """Sender-side abort frees the local pages and any ring pages and feature rows it held."""
    # capacity 1: b gets ring pages but no slot; a one-page ring: b gets no ring pages at all
    sizes = {"capacity": 1} if with_ring_allocation else {"num_pages": 1, "max_pages_per_handoff": 1}
    producer, _ = rings.create(**sizes)
    send_cache = make_kv_cache()
    sender, _ = sender_for(producer, send_cache)
    sender.add(prefilled_request(send_cache, "a", 3, 40))
    aborted = prefilled_request(send_cache, "b", 3, 41)
    aborted.image_embeds = torch.ones(5, FEATURE_DIM)
    sender.add(aborted)
    sender.pump()
    (item,) = sender.pending
    assert item.ring_pages == ([1] if with_ring_allocation else None)
    assert sender.abort("b") is aborted and sender.abort("b") is None and sender.abort("zzz") is None
    assert aborted.block_table == [] and sender.pending == []
    assert send_cache.pool.num_free == 8
    send_cache.pool.check_integrity()
    producer.check_integrity()
    assert producer.pages_free() == producer.spec.num_pages - 1  # only a's published page is held
    assert producer.alloc_features(32) == 0  # b's feature rows came back


def test_aborted_handoff_is_claimed_and_released_without_running(rings: RingFactory) -> None:
    """An aborted id at the head is dropped (even with no room); its id leaves the set."""
    producer, consumer = rings.create()
    send_cache, recv_cache = make_kv_cache(), make_kv_cache()
    sender, _ = sender_for(producer, send_cache)
    for i, rid in enumerate(("a", "b")):
        sender.add(prefilled_request(send_cache, rid, 6, 40 + i))
    sender.pump()
    receiver = HandoffReceiver([consumer], recv_cache)
    aborted = {"a", "later"}
    assert receiver.claim_ready(lambda n: False, aborted) == []
    assert aborted == {"later"}
    head = consumer.peek()
    assert head is not None and head.request_id == "b" and recv_cache.pool.num_free == 8
    assert [r.request_id for r in receiver.claim_ready(admit_all, aborted)] == ["b"]
    sender.pump()
    assert producer.pages_free() == 8 and sender.slots_used() == 0


def test_claims_start_round_robin_across_rings(rings: RingFactory) -> None:
    """Each claim_ready call starts at the next prefill worker's ring."""
    rings_pairs = [rings.create(), rings.create()]
    recv_cache = make_kv_cache(16)
    for p, (producer, _) in enumerate(rings_pairs):
        cache = make_kv_cache()
        sender, _ = sender_for(producer, cache)
        for k in range(2):
            sender.add(prefilled_request(cache, f"p{p}-{k}", 3, 40))
        assert len(sender.pump()) == 2
    receiver = HandoffReceiver([consumer for _, consumer in rings_pairs], recv_cache)

    def one_claim_per_call() -> list[str]:
        budget = [1]

        def admit(num_pages: int) -> bool:
            budget[0] -= 1
            return budget[0] >= 0

        return [r.request_id for r in receiver.claim_ready(admit, set())]

    assert [one_claim_per_call() for _ in range(4)] == [["p0-0"], ["p1-0"], ["p0-1"], ["p1-1"]]
    assert receiver.claim_ready(admit_all, set()) == []


def claim_two_small(rings: RingFactory, num_recv_pages: int, max_running: int,
                    lengths: tuple[int, int]) -> tuple[ContinuousBatchingScheduler, list[Request]]:
    """Publish two hand-offs and claim them with a real scheduler's can_admit, as the decode worker does."""
    producer, consumer = rings.create()
    send_cache, recv_cache = make_kv_cache(), make_kv_cache(num_recv_pages)
    sender, _ = sender_for(producer, send_cache)
    for rid, n in zip(("a", "b"), lengths, strict=True):
        sender.add(prefilled_request(send_cache, rid, n, 40))
    sender.pump()
    scheduler = ContinuousBatchingScheduler(recv_cache.pool, PAGE_SIZE, max_running, 64, 8)
    claimed = HandoffReceiver([consumer], recv_cache).claim_ready(scheduler.can_admit, set(), scheduler.add_running)
    return scheduler, claimed


def test_one_claim_ready_call_respects_max_running(rings: RingFactory) -> None:
    """With max_running 1, one claim_ready call over two ready hand-offs claims only one."""
    scheduler, claimed = claim_two_small(rings, 8, max_running=1, lengths=(3, 3))
    assert [r.request_id for r in claimed] == ["a"]
    assert len(scheduler.running) <= scheduler.max_running


def test_claimed_handoffs_are_not_preempted_by_the_next_decode_step(rings: RingFactory) -> None:
    """A claim takes the page its first decoded token needs, so a later claim cannot take it:
    b waits in the ring instead of being claimed and then preempted by the next step."""
    scheduler, claimed = claim_two_small(rings, 3, max_running=4, lengths=(8, 3))
    assert [(r.request_id, r.block_table) for r in claimed] == [("a", [0, 1, 2])]  # 8 tokens + the next
    assert scheduler.pool.num_free == 0
    out = scheduler.schedule()
    assert out.preempted == [] and [r.request_id for r in out.decode] == ["a"]


def test_a_higher_tier_handoff_displaces_a_running_lower_tier_request(rings: RingFactory) -> None:
    """No room for an interactive hand-off: the running batch request is preempted (recompute later)
    and the hand-off is claimed; without make_room nothing is claimed."""
    producer, consumer = rings.create()
    send_cache, recv_cache = make_kv_cache(), make_kv_cache(4)
    scheduler = ContinuousBatchingScheduler(recv_cache.pool, PAGE_SIZE, 4, 64, 8)
    running = make_request("batch", 12, priority=2)
    running.block_table = recv_cache.pool.allocate(4)  # every page
    scheduler.add_running(running)
    sender, _ = sender_for(producer, send_cache)
    sender.add(prefilled_request(send_cache, "inter", 6, 40, priority=0))
    sender.add(prefilled_request(send_cache, "std", 6, 41, priority=1))
    sender.pump()
    receiver = HandoffReceiver([consumer], recv_cache)
    assert receiver.claim_ready(scheduler.can_admit, set(), scheduler.add_running) == []  # without make_room
    claimed = receiver.claim_ready(scheduler.can_admit, set(), scheduler.add_running, scheduler.displace)
    # the batch request's 4 pages made room for both (2 pages each); "std" needed no displacement
    assert [(r.request_id, r.priority) for r in claimed] == [("inter", 0), ("std", 1)]
    assert running.status is RequestStatus.PREEMPTED and list(scheduler.waiting) == [running]
    assert scheduler.num_displaced == 1 and [r.request_id for r in scheduler.running] == ["inter", "std"]
    assert scheduler.pool.num_free == 0
    recv_cache.pool.check_integrity()


def test_a_handoff_too_large_for_the_slots_fails_its_request_not_the_worker(rings: RingFactory) -> None:
    """A request whose meta cannot fit a slot (the front end bounds what a request carries; this is the
    last guard): the sender drops it, frees both sides and reports it in ``failed``; the next request is
    published."""
    producer, _ = rings.create(meta_bytes=512)
    send_cache = make_kv_cache()
    sender, _ = sender_for(producer, send_cache)
    huge = prefilled_request(send_cache, "huge", 3, 40)
    huge.sampling_params = SamplingParams(max_tokens=4, structured=("regex", "a" * 2000))
    sender.add(huge)
    sender.add(prefilled_request(send_cache, "fine", 3, 41))
    published = sender.pump()
    assert [r.request_id for r in published] == ["fine"] and sender.pending == []
    ((failed, reason),) = sender.failed
    assert failed is huge and "does not fit" in reason and huge.block_table == []
    assert send_cache.pool.num_free == 8
    send_cache.pool.check_integrity()
    producer.check_integrity()
    assert producer.pages_free() == producer.spec.num_pages - 1  # only fine's page is held
