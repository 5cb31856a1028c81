"""Hand-off across Ray nodes next to the shared-memory ring, and 1P1D goodput across nodes.

Starts a two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: two raylets,
each with its own object store, so a hand-off between them goes through Ray's object
manager over TCP as between two machines; loopback only, no dashboard), then, in one run:

1. **Hand-off.** A producer actor and a consumer actor run the hand-off protocol through
   the one interface both transports have (:mod:`mm_serve.transport.base`):
   copy a request's KV pages out of a paged cache (random page ids) and its patch features
   in, publish; claim, copy into the other side's paged cache, release. Twice: both actors
   on node 0 over the shared-memory ring, then producer on node 0 and consumer on node 1
   over Ray (:class:`~mm_serve.transport.ray_ring.RayRing`). Per transport: steady-state
   throughput with up to ``--in-flight`` hand-offs outstanding (bytes/s at the consumer) and
   the latency of one hand-off alone (from the producer's first copy to the consumer's
   last, median of ``--latency-runs``).
2. **Goodput.** ``mm-serve bench --sweep`` (llava workload, ``--model``: the bench llava
   checkpoint of ``make bench-models`` by default) against
   ``mm-serve serve`` with ``cluster.backend: ray``, 1 prefill + 1 decode worker: both on
   node 0 (same node: the shared-memory ring), then prefill on node 0 and decode on node 1
   (the Ray transport). Admission prediction is off (``admission.predict: false``): its
   refusals early in a short run would count as misses and hide the transport.

Default hand-off shape: a 600-token LLaVA prompt (576 image rows) on a TinyLlama-1.1B-like
decoder (22 layers, 4 KV heads, head dim 64, hidden 2048, bf16, page size 16: 15.6 MiB per
hand-off), as ``benchmarks/ring_throughput.py``; ``--layers 32 --kv-heads 32 --head-dim 128
--hidden 4096`` is LLaVA-1.5-7B (300 MiB per hand-off: give the object stores room with
``--object-store-mib``).

Usage: ``python benchmarks/cross_node_handoff.py [--hand-offs 60] [--skip-goodput]``
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on the loopback address only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray's head asks the cloud metadata address which cloud it is on and posts a "usage disabled" note,
# both through `requests`: a proxy on a closed loopback port makes them fail here (as in the tests).
for _key in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
    os.environ.setdefault(_key, "http://127.0.0.1:9")
os.environ.setdefault("no_proxy", "127.0.0.1,localhost")
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
os.environ.setdefault("RAY_USAGE_STATS_REPORT_URL", "http://127.0.0.1:9/")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import msgspec  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from mm_serve.ground.dtypes import DTYPE_NAMES, torch_dtype  # noqa: E402
from mm_serve.transport.kv_transfer import copy_kv_from_ring, copy_kv_to_ring  # noqa: E402
from mm_serve.transport.ray_link import RayLink  # noqa: E402
from mm_serve.transport.registry import host_ring, ring_opener  # noqa: E402
from mm_serve.transport.ring_spec import Handoff, RingSpec, unique_ring_name  # noqa: E402

_ENGINE_PAGES = 256  # pages of each side's own paged cache
_POLL_S = 5e-5
NAMESPACE = "mmsrv-handoff-bench"


class HandoffActor:
    """One side of a benchmark ring (a Ray actor: ``deliver`` / ``released`` feed its link)."""

    def __init__(self, spec_bytes: bytes, side: str) -> None:
        torch.set_num_threads(1)
        self.spec = msgspec.msgpack.decode(spec_bytes, type=RingSpec)
        self.link = RayLink(NAMESPACE)
        self.ring = ring_opener(self.link, side)(self.spec)  # type: ignore[arg-type]
        self.kv = torch.ones(_ENGINE_PAGES, *self.spec.page_shape, dtype=torch_dtype(self.spec.dtype))
        self.rng = random.Random(0 if side == "producer" else 1)

    def deliver(self, ring: str, record: bytes, refs: list[Any]) -> None:
        self.link.deliver(ring, record, refs)

    def released(self, ring: str, seq: int) -> None:
        self.link.released(ring, seq)

    def produce(self, total: int, tokens: int, rows: int, one_at_a_time: bool) -> list[float]:
        """Publish ``total`` hand-offs; the wall time each one's copy started. ``one_at_a_time``:
        wait for each to be released before the next (latency)."""
        ring = self.ring
        starts: list[float] = []
        n_pages = -(-tokens // ring.spec.page_size)
        features = torch.ones(rows, ring.spec.feature_dim, dtype=self.kv.dtype)
        for index in range(total):
            while (pages := ring.alloc_pages(n_pages)) is None:
                time.sleep(_POLL_S)
            while (offset := ring.alloc_features(rows)) is None:
                ring.reclaim()
                time.sleep(_POLL_S)
            starts.append(time.time())
            copy_kv_to_ring(self.kv, self.rng.sample(range(_ENGINE_PAGES), n_pages), ring.pages, pages)
            ring.features[offset : offset + rows].copy_(features)
            ring.publish(Handoff(f"req-{index}", pages, tokens, 1, offset, rows, b""), timeout=None)
            while one_at_a_time and ring.slots_used():
                ring.reclaim()
                time.sleep(_POLL_S)
        while ring.slots_used():
            ring.reclaim()
            time.sleep(_POLL_S)
        return starts

    def consume(self, total: int) -> list[float]:
        """Claim, copy out and release ``total`` hand-offs; the wall time each copy ended."""
        ring = self.ring
        ends: list[float] = []
        features = torch.ones(ring.spec.feature_rows, ring.spec.feature_dim, dtype=self.kv.dtype)
        while len(ends) < total:
            if ring.peek() is None or (handoff := ring.claim()) is None:
                time.sleep(_POLL_S)
                continue
            dst = self.rng.sample(range(_ENGINE_PAGES), len(handoff.page_ids))
            copy_kv_from_ring(ring.pages, handoff.page_ids, self.kv, dst)
            start, rows = handoff.feature_offset, handoff.feature_rows
            features[:rows].copy_(ring.features[start : start + rows])
            ends.append(time.time())
            ring.release(handoff)
        return ends


def handoff_bytes(args: argparse.Namespace) -> int:
    """KV + feature bytes of one hand-off (whole pages)."""
    pages = -(-args.tokens // args.page_size)
    kv = pages * args.layers * 2 * args.page_size * args.kv_heads * args.head_dim
    return (kv + args.feature_rows * args.hidden) * torch_dtype(args.dtype).itemsize


def run_transport(args: argparse.Namespace, transport: str) -> tuple[float, float]:
    """(steady-state bytes/s, median seconds of one hand-off alone) over ``transport``."""
    pages = -(-args.tokens // args.page_size)
    spec = RingSpec(
        name=unique_ring_name(f"bench-{transport}"), num_pages=args.in_flight * pages,
        page_shape=(args.layers, 2, args.page_size, args.kv_heads, args.head_dim), dtype=args.dtype,
        feature_rows=args.in_flight * args.feature_rows, feature_dim=args.hidden, capacity=args.in_flight,
        max_pages_per_handoff=pages, meta_bytes=16, transport=transport,
        producer=f"{NAMESPACE}-{transport}-p" if transport == "ray" else "",
        consumer=f"{NAMESPACE}-{transport}-d" if transport == "ray" else "")
    hosted = host_ring(spec)  # the shared-memory segments; None over Ray
    actor_class = ray.remote(HandoffActor)
    consumer_node = "mm_serve_node_1" if transport == "ray" else "mm_serve_node_0"
    try:
        actors: list[Any] = [actor_class.options(  # type: ignore[attr-defined]
            name=f"{NAMESPACE}-{transport}-{tag}", namespace=NAMESPACE, num_cpus=0, max_concurrency=4,
            resources={node: 1}).remote(msgspec.msgpack.encode(spec), side)
            for tag, side, node in (("p", "producer", "mm_serve_node_0"), ("d", "consumer", consumer_node))]
        producer, consumer = actors
        total = args.warmup + args.hand_offs
        ends_ref = consumer.consume.remote(total)
        ray.get(producer.produce.remote(total, args.tokens, args.feature_rows, False))
        ends = ray.get(ends_ref)
        rate = handoff_bytes(args) * args.hand_offs / (ends[-1] - ends[args.warmup - 1])
        ends_ref = consumer.consume.remote(args.latency_runs)
        starts = ray.get(producer.produce.remote(args.latency_runs, args.tokens, args.feature_rows, True))
        ends = ray.get(ends_ref)
        latency = statistics.median(e - s for s, e in zip(starts, ends, strict=True))
        for actor in actors:
            ray.kill(actor)
        return rate, latency
    finally:
        if hosted is not None:
            hosted.close()
            hosted.unlink()


def goodput(args: argparse.Namespace, address: str, nodes: tuple[int, int], out: Path) -> float:
    """1P1D goodput (requests/s) of the llava workload with prefill on node ``nodes[0]`` and
    decode on node ``nodes[1]``, by ``mm-serve bench --sweep``."""
    config = out / "config.yaml"
    config.write_text(yaml.safe_dump({"cluster": {
        "backend": "ray", "address": address, "prefill_nodes": [nodes[0]], "decode_nodes": [nodes[1]]},
        "compute": {"threads_per_worker": 1},
        "admission": {"predict": False}}))  # the transport, not the admission predictor's early guesses
    cmd = [sys.executable, "-m", "mm_serve.cli.main", "bench", "--config", str(config), "--model", args.model,
           "--workload", "llava",
           "--sweep", "--slo-ttft", str(args.slo_ttft), "--slo-tpot", str(args.slo_tpot),
           "--num-requests", str(args.num_requests), "--seed", "0", "--out", str(out / "bench")]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return float(json.loads((out / "bench" / "bench.json").read_text())["systems"][0]["goodput"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hand-offs", type=int, default=60, help="timed hand-offs per transport")
    parser.add_argument("--warmup", type=int, default=10, help="untimed hand-offs first")
    parser.add_argument("--latency-runs", type=int, default=15, help="hand-offs timed one at a time")
    parser.add_argument("--in-flight", type=int, default=4, help="ring slots (hand-offs outstanding)")
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--feature-rows", type=int, default=576)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="bfloat16")
    parser.add_argument("--object-store-mib", type=int, default=200, help="object store per node")
    parser.add_argument("--skip-goodput", action="store_true")
    parser.add_argument("--slo-ttft", type=float, default=1.0)
    parser.add_argument("--slo-tpot", type=float, default=0.05)
    parser.add_argument("--num-requests", type=int, default=80, help="requests per goodput probe")
    parser.add_argument("--rounds", type=int, default=3, help="goodput sweeps per layout, alternating")
    parser.add_argument("--model", default="out/bench-llava", help="checkpoint for the goodput runs "
                        "(make bench-models builds out/bench-llava)")
    args = parser.parse_args()
    temp_dir = tempfile.mkdtemp(prefix="mmray-")  # Ray's sessions and logs, removed at the end
    os.environ["RAY_TMPDIR"] = temp_dir  # the cluster's address file too (default /tmp/ray, maybe absent)
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    node = {"node_ip_address": "127.0.0.1", "num_cpus": 1, "object_store_memory": args.object_store_mib << 20,
            "temp_dir": temp_dir}
    cluster = Cluster(initialize_head=True, head_node_args={
        **node, "resources": {"mm_serve_node_0": 100}, "include_dashboard": False})
    try:
        cluster.add_node(**node, resources={"mm_serve_node_1": 100})
        ray.init(address=cluster.address, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
        nbytes = handoff_bytes(args)
        print(f"hand-off {nbytes / 2**20:.1f} MiB ({args.tokens} tokens of KV + {args.feature_rows} feature rows), "
              f"{args.hand_offs} timed, up to {args.in_flight} in flight; latency: median of {args.latency_runs} alone")
        for transport, label in (("shm", "shared-memory ring, same node"), ("ray", "Ray object store, 2 nodes")):
            rate, latency = run_transport(args, transport)
            print(f"{label:32s}: {rate / 1e9:6.2f} GB/s   {latency * 1e3:7.1f} ms per hand-off")
        ray.shutdown()
        if not args.skip_goodput:
            print(f"goodput, 1P1D: llava workload, {args.model}, TTFT {args.slo_ttft} s, TPOT {args.slo_tpot} s, "
                  f"90 %, {args.num_requests} requests per probe; {args.rounds} alternating round(s)", flush=True)
            layouts = (((0, 0), "P and D on one node (shm ring)"), ((0, 1), "P and D on 2 nodes (Ray)"))
            results: dict[tuple[int, int], list[float]] = {nodes: [] for nodes, _ in layouts}
            with tempfile.TemporaryDirectory(prefix="mmsrv-goodput-") as tmp:
                for round_index in range(args.rounds):
                    for nodes, label in layouts:
                        out = Path(tmp) / f"r{round_index}-p{nodes[0]}d{nodes[1]}"
                        out.mkdir()
                        results[nodes].append(goodput(args, cluster.address, nodes, out))
                        print(f"  round {round_index + 1} {label:30s}: {results[nodes][-1]:.2f} req/s", flush=True)
            for nodes, label in layouts:
                print(f"{label:32s}: goodput median {statistics.median(results[nodes]):.2f} req/s "
                      f"(rounds: {', '.join(f'{g:.2f}' for g in results[nodes])})")
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
