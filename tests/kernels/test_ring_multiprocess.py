"""Cross-modal ring buffer across processes: 1,200 checksummed hand-offs, segment lifetime, crash cleanup."""

from __future__ import annotations

import multiprocessing
import os
import random
import subprocess
import sys
import time
import zlib
from pathlib import Path

import msgspec
import torch

from mm_serve.transport.kv_transfer import copy_kv_from_ring, copy_kv_to_ring
from mm_serve.transport.ring_spec import Handoff, RingSpec, unique_ring_name
from mm_serve.transport.shm_ring import ShmRing

NUM_HANDOFFS = 1200
ENGINE_PAGES = 32
REPO_ROOT = Path(__file__).resolve().parents[2]


def shm_entries(prefix: str) -> list[str]:
    """Names in /dev/shm that start with ``prefix``."""
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(prefix))


def make_spec() -> RingSpec:
    return RingSpec(
        name=unique_ring_name("mp"), num_pages=24, page_shape=(2, 2, 4, 2, 8), dtype="float32",
        feature_rows=64, feature_dim=16, capacity=8, max_pages_per_handoff=6, meta_bytes=48,
    )


def crc(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes in row-major order."""
    return zlib.crc32(tensor.contiguous().numpy().tobytes())


def pages_of(kv: torch.Tensor, page_ids: list[int]) -> torch.Tensor:
    """Engine pages ``page_ids`` of a ``[P, L, 2, S, H, D]`` cache, in that order."""
    return kv[page_ids]


def consume(spec_bytes: bytes, expected: int, results: multiprocessing.Queue) -> None:
    """Decode side (child process): claim, copy out, verify checksums and order, release."""
    spec = msgspec.msgpack.decode(spec_bytes, type=RingSpec)
    ring = ShmRing.attach(spec)
    kv = torch.zeros(ENGINE_PAGES, *spec.page_shape)
    errors: list[str] = []
    received = 0
    deadline = time.monotonic() + 60
    while received < expected and time.monotonic() < deadline:
        peeked = ring.peek()
        if peeked is None:
            time.sleep(0.0002)
            continue
        handoff = ring.claim()
        index, kv_crc, feature_crc = msgspec.msgpack.decode(handoff.meta if handoff else b"")
        dst = random.Random(index).sample(range(ENGINE_PAGES), len(peeked.page_ids))
        copy_kv_from_ring(ring.pages, peeked.page_ids, kv, dst)
        rows = ring.features[peeked.feature_offset : peeked.feature_offset + peeked.feature_rows]
        checks = {
            "peek == claim": handoff == peeked,
            "in order": (index, peeked.seq, peeked.request_id) == (received, received, f"req-{received}"),
            "first token": peeked.first_token == 7 * received,
            "kv checksum": crc(pages_of(kv, dst)) == kv_crc,
            "feature checksum": crc(rows.clone()) == feature_crc,
        }
        errors += [f"hand-off {received}: {name}" for name, ok in checks.items() if not ok]
        ring.release(peeked)
        received += 1
    results.put((received, errors[:5], ring.claim() is None))
    ring.close()


def produce(ring: ShmRing, index: int, kv: torch.Tensor, rng: random.Random) -> None:
    """Prefill side: allocate (waiting out backpressure), fill with random data, publish."""
    tokens = rng.randint(1, 24)
    rows = rng.choice([0, 0, 7, 16, 40])
    deadline = time.monotonic() + 30
    while (pages := ring.alloc_pages(-(-tokens // 4))) is None:
        assert time.monotonic() < deadline, "page pool never drained"
        time.sleep(0.0002)
    while (offset := ring.alloc_features(rows)) is None:
        assert time.monotonic() < deadline, "feature arena never drained"
        time.sleep(0.0002)
    src = rng.sample(range(ENGINE_PAGES), len(pages))
    kv[src] = torch.randn(kv[src].shape)
    copy_kv_to_ring(kv, src, ring.pages, pages)
    features = torch.randn(rows, ring.spec.feature_dim)
    ring.features[offset : offset + rows] = features
    meta = msgspec.msgpack.encode([index, crc(pages_of(kv, src)), crc(features)])
    handoff = Handoff(f"req-{index}", pages, tokens, 7 * index, offset, rows, meta)
    assert ring.publish(handoff, timeout=30)


def test_1200_handoffs_between_processes_arrive_verified_in_order() -> None:
    spec = make_spec()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with ShmRing.create(spec) as ring:
        child = ctx.Process(target=consume, args=(msgspec.msgpack.encode(spec), NUM_HANDOFFS, results))
        child.start()
        kv = torch.zeros(ENGINE_PAGES, *spec.page_shape)
        rng = random.Random(0)
        for index in range(NUM_HANDOFFS):
            produce(ring, index, kv, rng)
        received, errors, drained = results.get(timeout=60)
        child.join(timeout=30)
        assert (received, errors, drained, child.exitcode) == (NUM_HANDOFFS, [], True, 0)
        assert len(shm_entries(spec.name)) == 3  # the child exited first: nothing unlinked early
        ring.reclaim()
        assert ring.slots_used() == 0 and ring.pages_free() == spec.num_pages
        ring.check_integrity()
        assert ring._staging._arena.free_extents() == [(0, spec.feature_rows)]
    assert shm_entries(spec.name) == []


ATTACH_AND_EXIT = """
import sys, msgspec
from mm_serve.transport.ring_spec import RingSpec
from mm_serve.transport.shm_ring import ShmRing
ring = ShmRing.attach(msgspec.msgpack.decode(bytes.fromhex(sys.argv[1]), type=RingSpec))
ring.pages[3] = 5.0
ring.close()
"""

CREATE_AND_DIE = """
import os, sys, msgspec
from mm_serve.transport.ring_spec import RingSpec
from mm_serve.transport.shm_ring import ShmRing
ShmRing.create(msgspec.msgpack.decode(bytes.fromhex(sys.argv[1]), type=RingSpec))
print("created", flush=True)
os._exit(1)
"""


def run_python(code: str, spec: RingSpec) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (its own resource tracker), the spec as argv[1]."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    argv = [sys.executable, "-c", code, msgspec.msgpack.encode(spec).hex()]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)


def test_an_unrelated_attaching_process_does_not_unlink_on_exit() -> None:
    spec = make_spec()
    ring = ShmRing.create(spec)
    done = run_python(ATTACH_AND_EXIT, spec)
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr
    assert len(shm_entries(spec.name)) == 3
    assert torch.all(ring.pages[3] == 5.0)
    ring.close()
    ring.unlink()
    assert shm_entries(spec.name) == []


def test_a_crashed_owner_leaves_nothing_behind() -> None:
    spec = make_spec()
    done = run_python(CREATE_AND_DIE, spec)
    assert done.returncode == 1 and "created" in done.stdout, done.stderr
    deadline = time.monotonic() + 10
    while shm_entries(spec.name) and time.monotonic() < deadline:  # the tracker cleans up
        time.sleep(0.05)
    assert shm_entries(spec.name) == []
