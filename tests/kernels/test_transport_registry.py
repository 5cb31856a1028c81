"""The table of transports: every spec name has a class, each end opens the right one."""

from __future__ import annotations

import os

import msgspec
import pytest

from mm_serve.transport.ray_link import RayLink
from mm_serve.transport.ray_ring import RayRing
from mm_serve.transport.registry import TRANSPORTS, host_ring, ring_opener, transport_of
from mm_serve.transport.ring_spec import TRANSPORT_NAMES, RingSpec, unique_ring_name
from mm_serve.transport.shm_ring import ShmRing


def make_spec(**overrides: object) -> RingSpec:
    fields: dict[str, object] = dict(
        name=unique_ring_name("registry"), num_pages=8, page_shape=(1, 2, 4, 1, 2), dtype="float32",
        feature_rows=10, feature_dim=4, capacity=2, max_pages_per_handoff=4, meta_bytes=8)
    fields.update(overrides)
    return RingSpec(**fields)  # type: ignore[arg-type]


def shm_entries(prefix: str) -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(prefix))


def ray_spec() -> RingSpec:
    return make_spec(transport="ray", producer="ns-prefill0-g0", consumer="ns-decode0-g0")


def test_every_transport_name_has_its_class() -> None:
    assert tuple(TRANSPORTS) == TRANSPORT_NAMES == ("shm", "ray")
    assert transport_of(make_spec()) is ShmRing and transport_of(ray_spec()) is RayRing
    assert (ShmRing.same_node, RayRing.same_node) == (True, False)


def test_the_front_end_hosts_shared_memory_rings_only() -> None:
    assert host_ring(ray_spec()) is None
    spec = make_spec()
    hosted = host_ring(spec)
    assert isinstance(hosted, ShmRing)
    try:
        assert shm_entries(spec.name) == [f"{spec.name}-ctl", f"{spec.name}-feat", f"{spec.name}-kv"]
        producer = ring_opener(None, "producer")(spec)
        consumer = ring_opener(None, "consumer")(spec)
        assert isinstance(producer, ShmRing) and isinstance(consumer, ShmRing)
        assert producer.alloc_pages(2) == [0, 1] and hosted.pages_free() == 6  # one shared memory
        producer.close()
        consumer.close()
    finally:
        hosted.close()
        hosted.unlink()
    assert shm_entries(spec.name) == []


def test_a_ray_ring_opens_only_in_an_actor_and_stages_as_the_shared_ring() -> None:
    spec = ray_spec()
    with pytest.raises(ValueError, match="not a Ray actor"):
        ring_opener(None, "producer")(spec)
    ring = ring_opener(RayLink("ns"), "producer")(spec)
    assert isinstance(ring, RayRing) and ring.side == "producer"
    assert ring.alloc_pages(3) == [0, 1, 2] and ring.alloc_features(4) == 0
    assert ring.pages_free() == 5 and ring.slots_used() == 0
    ring.free_unpublished([0, 1, 2], 0, 4)
    assert ring.pages_free() == 8
    ring.close()
    with pytest.raises(ValueError, match="not 'ray'"):
        RayRing(make_spec(), RayLink("ns"), "consumer")


def test_a_spec_names_a_known_transport() -> None:
    with pytest.raises(ValueError, match="transport must be one of"):
        make_spec(transport="rdma")
    bad = msgspec.msgpack.encode(msgspec.structs.asdict(make_spec()) | {"transport": "rdma"})
    with pytest.raises(msgspec.ValidationError, match="transport"):
        msgspec.msgpack.decode(bad, type=RingSpec)
