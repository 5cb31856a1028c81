"""Cross-modal ring buffer in one process: exact seq/slot/version values, backpressure, versions, cleanup."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import torch

from mm_serve.transport.ring_layout import SlotStatus
from mm_serve.transport.ring_spec import Handoff, RingSpec, unique_ring_name
from mm_serve.transport.shm_ring import ShmRing

CAPACITY = 4
PAGE_SIZE = 4


def shm_entries(prefix: str) -> list[str]:
    """Names in /dev/shm that start with ``prefix``."""
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(prefix))


def make_spec(**overrides: object) -> RingSpec:
    fields: dict[str, object] = dict(
        name=unique_ring_name("test"), num_pages=16, page_shape=(2, 2, PAGE_SIZE, 2, 4),
        dtype="float32", feature_rows=32, feature_dim=8, capacity=CAPACITY,
        max_pages_per_handoff=4, meta_bytes=32,
    )
    fields.update(overrides)
    return RingSpec(**fields)  # type: ignore[arg-type]


@pytest.fixture
def rings() -> Iterator[tuple[ShmRing, ShmRing]]:
    """(producer = creator, consumer = attached) over one fresh ring; unlinked afterwards."""
    spec = make_spec()
    producer = ShmRing.create(spec)
    consumer = ShmRing.attach(spec)
    yield producer, consumer
    consumer.close()
    producer.close()
    producer.unlink()
    assert shm_entries(spec.name) == []


def offer(ring: ShmRing, i: int, tokens: int = 6, rows: int = 0) -> Handoff:
    """Allocate and describe hand-off ``i`` (not published)."""
    pages = ring.alloc_pages(-(-tokens // PAGE_SIZE))
    offset = ring.alloc_features(rows)
    assert pages is not None and offset is not None
    return Handoff(f"req-{i}", pages, tokens, 100 + i, offset, rows, f"meta-{i}".encode())


def test_wrap_around_three_and_a_half_laps(rings: tuple[ShmRing, ShmRing]) -> None:
    producer, consumer = rings
    slots = producer._slots  # the shared array, as the consumer sees it too
    for seq in range(14):  # 3.5 x capacity, one in flight at a time
        handoff = offer(producer, seq, rows=3)
        assert producer.publish(handoff) is True
        assert handoff.seq == seq
        slot = seq % CAPACITY
        assert (slots["seq"][slot], slots["version"][slot]) == (seq, seq // CAPACITY + 1)
        assert slots["status"][slot] == SlotStatus.READY
        claimed = consumer.claim()
        assert claimed == Handoff(f"req-{seq}", handoff.page_ids, 6, 100 + seq, 0, 3, f"meta-{seq}".encode(), seq)
        assert slots["status"][slot] == SlotStatus.CLAIMED
        consumer.release(claimed)
        assert producer.reclaim() == 1
        assert slots["status"][slot] == SlotStatus.EMPTY
        assert producer.slots_used() == 0 and producer.pages_free() == 16
    assert list(slots["version"]) == [4, 4, 3, 3]
    producer.check_integrity()


def test_fill_and_drain_laps_keep_order(rings: tuple[ShmRing, ShmRing]) -> None:
    producer, consumer = rings
    for lap in range(3):
        published = [offer(producer, lap * CAPACITY + i, tokens=3) for i in range(CAPACITY)]
        assert all(producer.publish(h) for h in published)
        assert producer.slots_used() == CAPACITY
        claimed = [consumer.claim() for _ in range(CAPACITY)]
        assert consumer.claim() is None
        assert [h.seq for h in claimed if h] == list(range(lap * CAPACITY, (lap + 1) * CAPACITY))
        for handoff in reversed(claimed):  # releases may come in any order
            assert handoff is not None
            consumer.release(handoff)
        assert producer.reclaim() == CAPACITY
    assert producer.pages_free() == 16 and producer.slots_used() == 0
    producer.check_integrity()


def test_peek_does_not_claim(rings: tuple[ShmRing, ShmRing]) -> None:
    producer, consumer = rings
    assert consumer.peek() is None
    handoff = offer(producer, 0, rows=5)
    producer.publish(handoff)
    assert consumer.peek() == consumer.peek() == handoff
    assert consumer.claim() == handoff
    assert consumer.peek() is None and consumer.claim() is None


def test_full_ring_blocks_the_producer_until_the_consumer_releases(
    rings: tuple[ShmRing, ShmRing],
) -> None:
    producer, consumer = rings
    for i in range(CAPACITY):
        assert producer.publish(offer(producer, i, tokens=2))
    blocked = offer(producer, CAPACITY, tokens=2)
    free_before = producer.pages_free()
    assert producer.publish(blocked, timeout=0) is False
    assert producer.publish(blocked, timeout=0.05) is False
    assert blocked.seq == -1 and producer.pages_free() == free_before  # nothing dropped or freed

    def consume_one() -> None:
        time.sleep(0.2)
        handoff = consumer.claim()
        assert handoff is not None
        consumer.release(handoff)

    thread = threading.Thread(target=consume_one)
    start = time.monotonic()
    thread.start()
    assert producer.publish(blocked, timeout=5) is True
    waited = time.monotonic() - start
    thread.join()
    assert 0.15 < waited < 5
    assert blocked.seq == CAPACITY and producer.slots_used() == CAPACITY


def test_full_pool_and_arena_are_backpressure(rings: tuple[ShmRing, ShmRing]) -> None:
    producer, consumer = rings
    handoffs = [offer(producer, i, tokens=16, rows=16) for i in range(2)]  # 8 of 16 pages, all rows
    assert producer.alloc_features(1) is None
    for handoff in handoffs:
        producer.publish(handoff)
    assert producer.alloc_pages(4) == [8, 9, 10, 11]
    assert producer.alloc_pages(4) == [12, 13, 14, 15]
    assert producer.alloc_pages(1) is None and producer.pages_free() == 0
    first = consumer.claim()
    assert first is not None
    consumer.release(first)
    assert producer.alloc_pages(4) == [0, 1, 2, 3]  # reclaims on demand
    assert producer.alloc_features(16) == 0


def test_wrong_version_is_never_consumed(rings: tuple[ShmRing, ShmRing]) -> None:
    producer, consumer = rings
    shared = consumer._slots
    producer.publish(offer(producer, 0))
    for bad_version in (0, 2, 7):  # never published, a future lap, garbage
        shared["version"][0] = bad_version
        assert consumer.peek() is None and consumer.claim() is None
    shared["version"][0] = 1
    shared["seq"][0] = 5  # right version, payload of another sequence number
    assert consumer.claim() is None
    shared["seq"][0] = 0
    shared["status"][0] = SlotStatus.WRITING
    assert consumer.claim() is None
    shared["status"][0] = SlotStatus.READY
    assert shared["status"][0] == SlotStatus.READY and consumer.slots_used() == 1
    handoff = consumer.claim()
    assert handoff is not None and handoff.seq == 0


def test_stale_lap_is_not_consumed_again(rings: tuple[ShmRing, ShmRing]) -> None:
    producer, consumer = rings
    producer.publish(offer(producer, 0))
    handoff = consumer.claim()
    assert handoff is not None
    consumer.release(handoff)
    producer.reclaim()
    consumer._slots["status"][0] = SlotStatus.READY  # slot 0 still holds version 1 (lap of seq 0)
    for _ in range(CAPACITY - 1):
        producer.publish(offer(producer, 1))
        claimed = consumer.claim()
        assert claimed is not None
        consumer.release(claimed)
    assert consumer.claim() is None  # seq 4 wants version 2 in slot 0


def test_invalid_handoffs_and_releases_raise(rings: tuple[ShmRing, ShmRing]) -> None:
    producer, consumer = rings
    handoff = offer(producer, 0, tokens=6, rows=2)
    for bad in (
        Handoff("x" * 65, handoff.page_ids, 6, 0, 0, 2, b""),
        Handoff("r", handoff.page_ids, 6, 0, 0, 2, b"m" * 33),
        Handoff("r", handoff.page_ids, 9, 0, 0, 2, b""),  # 9 tokens need 3 pages
        Handoff("r", [15, 14], 6, 0, 0, 2, b""),  # pages not allocated
        Handoff("r", handoff.page_ids, 6, 0, 4, 2, b""),  # wrong extent
        Handoff("r", handoff.page_ids, 6, 0, 4, 0, b""),  # offset without features
    ):
        with pytest.raises(ValueError):
            producer.publish(bad)
    assert producer.publish(handoff)
    with pytest.raises(ValueError, match="not all allocated and unpublished"):
        producer.publish(Handoff("again", handoff.page_ids, 6, 0, 0, 0, b""))
    with pytest.raises(ValueError, match="alloc"):
        producer.free_unpublished(handoff.page_ids, 0, 0)
    claimed = consumer.claim()
    assert claimed is not None
    consumer.release(claimed)
    with pytest.raises(ValueError, match="not claimed"):
        consumer.release(claimed)
    with pytest.raises(ValueError, match="cannot hand off 5 pages"):
        producer.alloc_pages(5)


def test_aborted_allocations_are_given_back(rings: tuple[ShmRing, ShmRing]) -> None:
    producer, _ = rings
    handoff = offer(producer, 0, tokens=13, rows=20)
    assert producer.pages_free() == 12
    producer.free_unpublished(handoff.page_ids, handoff.feature_offset, handoff.feature_rows)
    assert producer.pages_free() == 16 and producer.alloc_features(32) == 0
    producer.check_integrity()


def test_pages_and_features_are_shared_between_the_two_views(
    rings: tuple[ShmRing, ShmRing],
) -> None:
    producer, consumer = rings
    assert producer.pages.shape == (16, 2, 2, PAGE_SIZE, 2, 4)
    assert consumer.features.shape == (32, 8)
    handoff = offer(producer, 0, tokens=5, rows=4)
    producer.pages[handoff.page_ids] = torch.arange(2.0).view(2, 1, 1, 1, 1, 1)
    producer.features[0:4] = 7.0
    producer.publish(handoff)
    claimed = consumer.claim()
    assert claimed is not None
    assert consumer.pages[claimed.page_ids].sum().item() == 128.0  # 128 elements per page: 0s, 1s
    assert torch.all(consumer.features[0:4] == 7.0)


def test_attach_checks_the_spec_and_existence() -> None:
    spec = make_spec()
    with pytest.raises(FileNotFoundError):
        ShmRing.attach(spec)
    with ShmRing.create(spec) as ring:
        with pytest.raises(FileExistsError):
            ShmRing.create(spec)
        assert len(shm_entries(spec.name)) == 3  # the failed create removed nothing
        with pytest.raises(ValueError, match="another spec"):
            ShmRing.attach(msgspec.structs.replace(spec, meta_bytes=24))
        ring.pages[0] = 1.0
    assert shm_entries(spec.name) == []


def test_close_and_unlink_are_idempotent_and_leave_nothing() -> None:
    spec = make_spec(feature_rows=0)  # text-only ring
    owner = ShmRing.create(spec)
    other = ShmRing.attach(spec)
    assert owner.features.shape == (0, 8) and owner.alloc_features(0) == 0
    assert shm_entries(spec.name) == [f"{spec.name}-ctl", f"{spec.name}-feat", f"{spec.name}-kv"]
    with pytest.raises(RuntimeError, match="only the creating side"):
        other.unlink()
    other.close()
    other.close()
    with pytest.raises(RuntimeError, match="closed"):
        other.claim()
    assert len(shm_entries(spec.name)) == 3
    owner.close()
    owner.unlink()
    owner.unlink()
    assert shm_entries(spec.name) == []


def test_spec_round_trips_through_msgpack_and_validates() -> None:
    spec = make_spec()
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=RingSpec) == spec
    listed = make_spec(name=spec.name, page_shape=[2, 2, PAGE_SIZE, 2, 4])  # normalised to a tuple
    assert listed == spec and listed.fingerprint() == spec.fingerprint()
    with pytest.raises(ValueError, match="power of two"):
        make_spec(capacity=6)
    with pytest.raises(ValueError, match="page_shape"):
        make_spec(page_shape=(2, 3, 4, 2, 4))
    with pytest.raises(ValueError, match="ring name"):
        make_spec(name="has/slash")
    bad = msgspec.msgpack.encode(msgspec.structs.asdict(spec) | {"dtype": "int8"})
    with pytest.raises(msgspec.ValidationError, match="dtype"):
        msgspec.msgpack.decode(bad, type=RingSpec)
    assert unique_ring_name("p0d0") != unique_ring_name("p0d0")
