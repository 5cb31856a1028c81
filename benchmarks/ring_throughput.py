"""Cross-modal ring buffer hand-off throughput next to a plain tensor copy of the same bytes.

A producer process (prefill side) copies each hand-off's KV pages from its own
paged cache (page-major, like the ring) into the ring (``copy_kv_to_ring``) and its patch
features into the feature arena, then publishes; a consumer process (decode
side, spawned, attached by ``RingSpec``) claims, copies the pages into its own
paged cache (``copy_kv_from_ring``) and the features into its own tensor, and
releases. Page ids are random on both engine sides (fragmented block tables).

Throughput = hand-off bytes (KV + features, counted once) / time, measured at
the consumer in steady state (after ``--warmup`` hand-offs). The baseline is
``dst.copy_(src)`` of the same bytes per hand-off in one process, rotating over
buffers larger than the last-level cache (and, for reference, the same buffer
again and again: cache-hot). It also prints the CPU time per hand-off of each
side (``time.thread_time``): on a shared machine the two processes may not get
a core each, and the CPU figures say what the ring would do if they did.

Each process uses ``--threads`` torch threads (default 1): on a busy machine
OpenMP threads that wait for a descheduled sibling make copies far slower.

Default shapes: a TinyLlama-1.1B-like decoder (22 layers, 4 KV heads, head dim
64, hidden 2048, bf16), page size 16, 600-token prompts with 576 image rows.

Usage: ``python benchmarks/ring_throughput.py [--hand-offs 120] [--threads 1]``
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import time

import msgspec
import torch

from mm_serve.ground.dtypes import DTYPE_NAMES, torch_dtype
from mm_serve.transport.kv_transfer import copy_kv_from_ring, copy_kv_to_ring
from mm_serve.transport.ring_spec import Handoff, RingSpec, unique_ring_name
from mm_serve.transport.shm_ring import ShmRing

_ENGINE_PAGES = 256  # pages in each side's own paged cache
_IN_FLIGHT = 4  # hand-offs the ring's pool, arena and slots hold at once
_POLL_S = 5e-5


def _spec(args: argparse.Namespace) -> RingSpec:
    pages = -(-args.tokens // args.page_size)
    return RingSpec(
        name=unique_ring_name("bench"), num_pages=_IN_FLIGHT * pages,
        page_shape=(args.layers, 2, args.page_size, args.kv_heads, args.head_dim),
        dtype=args.dtype, feature_rows=_IN_FLIGHT * args.feature_rows, feature_dim=args.hidden,
        capacity=_IN_FLIGHT, max_pages_per_handoff=pages, meta_bytes=16,
    )


def _engine_cache(spec: RingSpec) -> torch.Tensor:
    """A page-major ``[pages, L, 2, S, H, D]`` cache (:class:`PagedKVCache`'s layout), touched so
    no page faults are timed."""
    return torch.ones(_ENGINE_PAGES, *spec.page_shape, dtype=torch_dtype(spec.dtype))


def _consume(spec_bytes: bytes, total: int, warmup: int, threads: int, out: multiprocessing.Queue) -> None:
    """Decode side: claim, copy KV and features out, release.

    Puts (wall time of the last warm-up release, of the last release, CPU seconds of the timed part).
    """
    torch.set_num_threads(threads)
    spec = msgspec.msgpack.decode(spec_bytes, type=RingSpec)
    ring = ShmRing.attach(spec)
    kv = _engine_cache(spec)
    features = torch.ones(spec.feature_rows, spec.feature_dim, dtype=kv.dtype)
    rng = random.Random(1)
    stamps: list[float] = []
    cpu_start = 0.0
    while len(stamps) < total:
        handoff = ring.claim()
        if handoff is None:
            time.sleep(_POLL_S)
            continue
        dst = rng.sample(range(_ENGINE_PAGES), len(handoff.page_ids))
        copy_kv_from_ring(ring.pages, handoff.page_ids, kv, dst)
        start, rows = handoff.feature_offset, handoff.feature_rows
        features[:rows].copy_(ring.features[start : start + rows])
        ring.release(handoff)
        stamps.append(time.monotonic())
        if len(stamps) == warmup:
            cpu_start = time.thread_time()
    out.put((stamps[warmup - 1], stamps[-1], time.thread_time() - cpu_start))
    ring.close()


def _produce(ring: ShmRing, total: int, warmup: int, tokens: int, rows: int) -> float:
    """Prefill side: allocate (waiting out backpressure), copy KV and features in, publish.

    Returns the CPU seconds of the timed (post-warm-up) hand-offs.
    """
    kv = _engine_cache(ring.spec)
    features = torch.ones(rows, ring.spec.feature_dim, dtype=kv.dtype)
    rng = random.Random(0)
    n_pages = -(-tokens // ring.spec.page_size)
    cpu_start = 0.0
    for index in range(total):
        if index == warmup:
            cpu_start = time.thread_time()
        while (pages := ring.alloc_pages(n_pages)) is None:
            time.sleep(_POLL_S)
        while (offset := ring.alloc_features(rows)) is None:
            time.sleep(_POLL_S)
        copy_kv_to_ring(kv, rng.sample(range(_ENGINE_PAGES), n_pages), ring.pages, pages)
        ring.features[offset : offset + rows].copy_(features)
        handoff = Handoff(f"req-{index}", pages, tokens, 1, offset, rows, b"")
        ring.publish(handoff, timeout=None)
    return time.thread_time() - cpu_start


def ring_throughput(args: argparse.Namespace) -> tuple[float, float, float]:
    """(steady-state hand-off bytes/s, producer and consumer CPU seconds per hand-off)."""
    spec = _spec(args)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    total = args.warmup + args.hand_offs
    with ShmRing.create(spec) as ring:
        child = ctx.Process(
            target=_consume, args=(msgspec.msgpack.encode(spec), total, args.warmup, args.threads, out)
        )
        child.start()
        producer_cpu = _produce(ring, total, args.warmup, args.tokens, args.feature_rows)
        first, last, consumer_cpu = out.get(timeout=600)
        child.join()
    n = args.hand_offs
    return handoff_bytes(args) * n / (last - first), producer_cpu / n, consumer_cpu / n


def handoff_bytes(args: argparse.Namespace) -> int:
    """KV + feature bytes of one hand-off (whole pages)."""
    pages = -(-args.tokens // args.page_size)
    itemsize = torch_dtype(args.dtype).itemsize
    kv = pages * args.layers * 2 * args.page_size * args.kv_heads * args.head_dim
    return (kv + args.feature_rows * args.hidden) * itemsize


def copy_throughput(nbytes: int, reps: int, buffers: int) -> tuple[float, float]:
    """(bytes/s, CPU seconds per copy) of ``dst.copy_(src)`` of ``nbytes``, rotating over
    ``buffers`` source/destination pairs."""
    src = torch.ones(buffers, nbytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    for i in range(buffers):
        dst[i].copy_(src[i])
    start, cpu_start = time.perf_counter(), time.thread_time()
    for i in range(reps):
        dst[i % buffers].copy_(src[i % buffers])
    cpu = (time.thread_time() - cpu_start) / reps
    return nbytes * reps / (time.perf_counter() - start), cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hand-offs", type=int, default=120, help="timed hand-offs")
    parser.add_argument("--warmup", type=int, default=20, help="untimed hand-offs first")
    parser.add_argument("--tokens", type=int, default=600, help="prompt tokens per hand-off")
    parser.add_argument("--feature-rows", type=int, default=576, help="image feature rows per hand-off")
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="bfloat16")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per ring process")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    nbytes = handoff_bytes(args)
    ring, producer_cpu, consumer_cpu = ring_throughput(args)
    copy, copy_cpu = copy_throughput(nbytes, args.hand_offs, buffers=8)
    hot, _ = copy_throughput(nbytes, args.hand_offs, buffers=1)
    bound = nbytes / max(producer_cpu, consumer_cpu)  # if each side had a core to itself
    print(f"hand-off {nbytes / 2**20:.1f} MiB ({args.tokens} tokens of KV + {args.feature_rows} feature rows), "
          f"{args.hand_offs} timed, torch threads per process: {args.threads}")
    print(f"ring hand-off, 2 processes : {ring / 1e9:6.2f} GB/s")
    print(f"plain copy_, 8 buffers     : {copy / 1e9:6.2f} GB/s   ring/copy = {ring / copy:.0%}")
    print(f"plain copy_, cache-hot     : {hot / 1e9:6.2f} GB/s   ring/copy = {ring / hot:.0%}")
    print(f"CPU ms per hand-off: producer {producer_cpu * 1e3:.2f}, consumer {consumer_cpu * 1e3:.2f}, "
          f"plain copy {copy_cpu * 1e3:.2f}; with a free core per side the ring would do "
          f"{bound / 1e9:.2f} GB/s = {copy_cpu / max(producer_cpu, consumer_cpu):.0%} of the copy's CPU rate")


if __name__ == "__main__":
    main()
