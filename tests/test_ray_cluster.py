"""Workers on a two-node Ray cluster: prefill on one node, decode on the other, hand-offs over Ray.

One cluster for the whole module (``ray.cluster_utils.Cluster``: two raylets on this
machine, each with its own object store, so a hand-off between them goes through Ray's
object manager as between two machines), bound to 127.0.0.1 only: every node's address,
the driver's, the GCS and the object managers (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
makes Ray resolve "this node" to the loopback address instead of the outward interface);
no dashboard, no usage reporting, 128 MiB object stores. Ray's head still starts a minimal
API server that asks the cloud metadata address (169.254.169.254) which cloud it runs on and
posts a "usage stats disabled" note to Ray's server; both go through ``requests``, so the
cluster's processes get a proxy on a closed loopback port (:data:`LOOPBACK_ONLY_ENV`) and those
calls fail at once on 127.0.0.1. The cluster is stopped at the end and no Ray process may be left.
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before ray is imported: loopback only
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

import json  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402

from mm_serve.cli.main import main as cli_main  # noqa: E402
from mm_serve.cluster.ray_worker import RayWorkerHandle  # noqa: E402
from mm_serve.config import ConfigError, config_from_dict, load_config  # noqa: E402
from mm_serve.engine.engine_client import EngineClient  # noqa: E402
from mm_serve.runtime.sampling_params import SamplingParams  # noqa: E402
from tests.factories import gradient_image  # noqa: E402
from tests.golden import load_reference, reference_generate  # noqa: E402
from tests.test_disaggregation import CASES, GREEDY, Q2, Q  # noqa: E402

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")

OBJECT_STORE_BYTES = 128 << 20
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
DEAD_PORT = "http://127.0.0.1:9"  # discard port, nothing listens: a request there fails at once
LOOPBACK_ONLY_ENV = {
    "http_proxy": DEAD_PORT, "https_proxy": DEAD_PORT, "HTTP_PROXY": DEAD_PORT, "HTTPS_PROXY": DEAD_PORT,
    "no_proxy": "127.0.0.1,localhost", "NO_PROXY": "127.0.0.1,localhost",
    "RAY_USAGE_STATS_REPORT_URL": f"{DEAD_PORT}/",
}
RAY_PROCESS_NAMES = ("raylet", "gcs_server", "plasma_store", "ray::", "dashboard", "runtime_env")


def ray_processes() -> list[str]:
    """Command lines of Ray processes on this machine (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(name in cmd for name in RAY_PROCESS_NAMES) and "pytest" not in cmd:
            out.append(f"{entry}: {cmd[:120]}")
    return out


def worker_actors() -> list[str]:
    """The worker actors' processes on this machine (Ray titles them ``ray::<actor name>``,
    ``ray::RayWorker`` while the actor starts)."""
    return [p for p in ray_processes() if p.split(": ", 1)[1].startswith(("ray::mmsrv-", "ray::RayWorker"))]


@dataclass
class TwoNodes:
    """The test cluster and what its second node was started with (to start it again)."""

    cluster: Any  # ray.cluster_utils.Cluster
    second_node_args: dict[str, Any]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[TwoNodes]:
    """Two Ray nodes on 127.0.0.1 offering mm_serve_node_0 and mm_serve_node_1."""
    from ray.cluster_utils import Cluster

    before = set(ray_processes())  # another Ray on the machine is not ours to judge
    temp_dir = tempfile.mkdtemp(prefix="mmray-")  # short: Ray's unix socket paths live under it
    # Ray writes the cluster's address to $RAY_TMPDIR/ray/ray_current_cluster (default /tmp/ray, which a
    # fresh machine lacks and which would outlive the test): point it into our temp dir
    env = {**LOOPBACK_ONLY_ENV, "RAY_TMPDIR": temp_dir}
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # inherited by every Ray process the cluster starts
    node: dict[str, Any] = {"node_ip_address": "127.0.0.1", "num_cpus": 1, "object_store_memory": OBJECT_STORE_BYTES,
            "temp_dir": temp_dir}
    c = Cluster(initialize_head=True, head_node_args={
        **node, "resources": {"mm_serve_node_0": 100}, "include_dashboard": False})
    try:
        second: dict[str, Any] = {**node, "resources": {"mm_serve_node_1": 100}}
        c.add_node(**second)
        yield TwoNodes(c, second)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        deadline = time.monotonic() + 20
        while set(ray_processes()) - before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sorted(set(ray_processes()) - before) == [], "the cluster left Ray processes behind"
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(ray_cluster: TwoNodes) -> str:
    """The cluster's address."""
    return str(ray_cluster.cluster.address)


def ray_config(address: str, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "kv_cache": {"max_pages_per_gpu": 256},
        "compute": {"threads_per_worker": 1},
        "cluster": {"backend": "ray", "address": address, "prefill_nodes": [0], "decode_nodes": [1]},
        "fault": {"restart_backoff_s": 0.1},
    }
    for key, value in extra.items():
        base.setdefault(key, {}).update(value)
    return base


@pytest.fixture(scope="module")
def client(cluster: str, tiny_llava: Path) -> Iterator[EngineClient]:
    """A 1P1D service: prefill actor on node 0, decode actor on node 1."""
    c = EngineClient(tiny_llava, config_from_dict(ray_config(cluster)))
    c.start()
    try:
        yield c
    finally:
        c.shutdown()
    assert not ray.is_initialized(), "the pool leaves the cluster it joined"
    assert not c.pool.run_dir.exists()


@pytest.fixture(scope="module")
def reference_tokens(client: EngineClient, tiny_llava: Path) -> list[list[int]]:
    reference = load_reference(tiny_llava, multimodal=True)
    return [reference_generate(reference, client.inputs.process(r), 32)[0] for r in CASES]


def run(client: EngineClient, tag: str, inputs: list[Any], params: list[SamplingParams]) -> list[Any]:
    states = [client.submit(f"{tag}-{i}", client.inputs.process(x), p)
              for i, (x, p) in enumerate(zip(inputs, params, strict=True))]
    for s in states:
        assert s.wait(120), "request did not finish"
    return states


def wait_for(predicate: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def assert_all_free(client: EngineClient) -> None:
    """Every KV page, ring slot and ring page free on both nodes, every worker ready."""
    wait_for(lambda: client.health()["status"] == "ok")

    def clean() -> bool:
        stats = client.query_stats()
        return set(stats) == set(client.pool.keys) and all(
            (s.kv_pages_used, s.ring_slots_used, s.ring_pages_held, s.running, s.waiting) == (0, 0, 0, 0, 0)
            and s.pages_integrity_ok for s in stats.values())

    wait_for(clean, 10)


def handles(client: EngineClient) -> dict[tuple[str, int], RayWorkerHandle]:
    out = {}
    for key, worker in client.pool.workers.items():
        assert isinstance(worker.process, RayWorkerHandle)
        out[key] = worker.process
    return out


def test_prefill_and_decode_on_different_nodes_equal_transformers(
        client: EngineClient, reference_tokens: list[list[int]]) -> None:
    assert client.pool.ring_transports() == ["ray"] and client.pool.rings == []
    before = client.query_stats()[("decode", 0)].ray_handoffs
    states = run(client, "golden", CASES, [GREEDY] * len(CASES))
    assert [s.token_ids for s in states] == reference_tokens
    stats = client.query_stats()
    assert stats[("decode", 0)].ray_handoffs - before == len(CASES), "every hand-off went through Ray"
    workers = handles(client)
    assert workers[("prefill", 0)].node_id and workers[("decode", 0)].node_id
    assert workers[("prefill", 0)].node_id != workers[("decode", 0)].node_id
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    assert "mm_serve_node_0" in nodes[workers[("prefill", 0)].node_id]
    assert "mm_serve_node_1" in nodes[workers[("decode", 0)].node_id]
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}


def test_pairs_on_the_front_end_node_keep_the_shared_memory_ring(
        cluster: str, tiny_llava: Path, client: EngineClient, reference_tokens: list[list[int]]) -> None:
    """2P1D with prefill 0 and the decode worker on node 0, the front end's (a driver joins the
    head node), and prefill 1 on node 1: one decode worker claims from a shared-memory ring and
    from a Ray one, and the outputs are the same."""
    cfg = ray_config(cluster, compute={"prefill_workers": 2}, cluster={"prefill_nodes": [0, 1], "decode_nodes": [0]})
    other = EngineClient(tiny_llava, config_from_dict(cfg))
    other.start()
    try:
        assert other.pool.ring_transports() == ["shm", "ray"] and len(other.pool.rings) == 1
        states = run(other, "mixed-transports", CASES, [GREEDY] * len(CASES))
        assert [s.token_ids for s in states] == reference_tokens
        stats = other.query_stats()
        assert 0 < stats[("decode", 0)].ray_handoffs < len(CASES), "both rings carried hand-offs"
        assert_all_free(other)
    finally:
        other.shutdown()
    assert ray.is_initialized(), "a pool that found the connection open leaves it open"


def test_100_mixed_requests_leave_every_page_free_on_both_nodes(client: EngineClient) -> None:
    inputs: list[Any] = []
    for i in range(100):
        if i % 3 == 0:
            inputs.append({"prompt": f"Request {i}: tell me about the number {i}"})
        elif i % 3 == 1:
            inputs.append({"prompt": Q, "images": [gradient_image(30 + i % 50, 40, i)]})
        else:
            inputs.append({"prompt": Q2, "images": [gradient_image(20, 20, i), gradient_image(45, 30, i + 1)]})
    params = [SamplingParams(max_tokens=2 + i % 7, temperature=0.0 if i % 2 else 0.7, seed=i) for i in range(100)]
    states = run(client, "mixed", inputs, params)
    assert all(s.error is None and 1 <= len(s.token_ids) <= 2 + i % 7 for i, s in enumerate(states))
    assert_all_free(client)


def test_abort_during_a_cross_node_handoff_frees_both_sides(client: EngineClient) -> None:
    """The decode actor is stopped, so the hand-off sits published and unclaimed (its pages
    staged on the prefill node, its object in that node's store); the abort frees both sides."""
    decode_pid = handles(client)[("decode", 0)].pid
    assert decode_pid > 0
    os.kill(decode_pid, signal.SIGSTOP)
    try:
        state = client.submit("abort-me", client.inputs.process(CASES[2]), LONG)
        wait_for(lambda: client.query_stats()[("prefill", 0)].ring_slots_used == 1, 20)
        assert client.query_stats()[("prefill", 0)].ring_pages_held > 0
        client.abort("abort-me")
    finally:
        os.kill(decode_pid, signal.SIGCONT)
    assert state.wait(30)
    assert_all_free(client)


def test_decode_actor_killed_mid_stream_is_survived(client: EngineClient) -> None:
    """1,000 tokens: the stream must still be running when its actor is frozen (200 tokens of the tiny model
    finished in the polling gap between the 20th token seen and the SIGSTOP on a fast CPU)."""
    request = {"prompt": Q, "images": [gradient_image(50, 40, 7)]}
    long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    (reference,) = run(client, "ref", [request], [long])
    restarts = client.fault_report()[0].get(("worker_restarts", "decode"), 0)
    old = handles(client)[("decode", 0)]
    assert old.pid > 0  # its pid is a Ray call the first time: made before the request starts
    state = client.submit("killed", client.inputs.process(request), long)
    wait_for(lambda: len(state.token_ids) >= 20, 60)
    os.kill(old.pid, signal.SIGSTOP)  # frozen mid-stream first, so the request cannot finish before the kill
    time.sleep(0.2)
    assert len(state.token_ids) < long.max_tokens, "the request finished before the actor was frozen"
    os.kill(old.pid, signal.SIGKILL)  # the actor's process, at once (ray.kill is asynchronous)
    assert state.wait(120) and state.error is None
    assert state.token_ids == reference.token_ids and len(state.token_ids) == long.max_tokens
    assert client.fault_report()[0][("request_migrations", "decode")] >= 1
    assert client.fault_report()[0][("worker_restarts", "decode")] == restarts + 1
    new = handles(client)[("decode", 0)]
    assert new.name != old.name and new.name.endswith("-g1")
    assert_all_free(client)
    assert new.node_id == old.node_id, "the restarted actor is on the node its placement names"
    (after,) = run(client, "after", [request], [long])
    assert after.token_ids == reference.token_ids


def test_a_node_no_ray_node_offers_fails_the_start_naming_the_key(cluster: str, tiny_llava: Path) -> None:
    cfg = ray_config(cluster, cluster={"decode_nodes": [3]})
    other = EngineClient(tiny_llava, config_from_dict(cfg))
    with pytest.raises(ConfigError, match=r"cluster.decode_nodes names node 3, but no node of the Ray cluster "
                                          r"offers the resource 'mm_serve_node_3'"):
        other.start()
    assert not other.pool.run_dir.exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_profile(model: Path) -> dict[str, Any]:
    """An ``mm-serve profile``-format file for one CPU worker slot of the tiny model: forward
    times of the order measured here, 48 MiB usable after the 90 % and the 2 GiB the planner keeps back (a small KV cache)."""
    return {
        "format": "mm-serve-profile/1", "name": "cpu-test", "device": "1 CPU core", "memory_bytes": int(((2 << 30) + (48 << 20)) / 0.9),
        "model": str(model),
        "prefill": [{"tokens": t, "batch": 1, "seconds": 0.002 + t * 2e-5} for t in (16, 64, 256)],
        "decode": [{"batch": b, "context": c, "seconds": 0.002 + b * 1e-4 + b * c * 1e-7}
                   for b in (1, 8) for c in (64, 256)],
        "encode": [{"images": k, "seconds": 0.001 + 0.002 * k} for k in (1, 2)],
    }


def test_planned_two_node_config_serves_on_the_cluster(cluster: str, tiny_llava: Path, tmp_path: Path) -> None:
    """``mm-serve plan --nodes 2 --write-config`` writes a config that ``mm-serve serve`` runs
    as it is on the two-node cluster (prefill and decode on the nodes the plan chose)."""
    profile = tmp_path / "cpu-profile.json"
    profile.write_text(json.dumps(cpu_profile(tiny_llava)))
    path = tmp_path / "two-node.yaml"
    assert cli_main(["plan", "--model", str(tiny_llava), "--slo-ttft", "1", "--slo-tpot", "0.1",
                     "--hardware", str(profile), "--nodes", "2", "--gpus-per-node", "1", "--device", "cpu",
                     "--num-requests", "100", "--write-config", str(path)]) == 0
    cfg = load_config(path)
    assert cfg.cluster.backend == "ray" and not cfg.compute.prefill_gpus and not cfg.compute.decode_gpus
    assert sorted(cfg.cluster.prefill_nodes + cfg.cluster.decode_nodes) == [0, 1]
    port = free_port()
    actors_before = len(worker_actors())
    proc = subprocess.Popen(
        [sys.executable, "-m", "mm_serve.cli.main", "serve", "--config", str(path), "--port", str(port),
         "--ray-address", cluster], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "server not ready"
            try:
                if httpx.get(f"{url}/health", timeout=2).json().get("status") == "ok":
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert len(worker_actors()) == actors_before + 2, "its prefill and decode actors"
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": str(tiny_llava), "prompt": "Serving a language model means", "max_tokens": 8,
            "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    output = proc.stdout.read() if proc.stdout else ""
    assert proc.returncode in (0, -signal.SIGTERM), output  # uvicorn re-raises the signal it drained on
    assert "stopping: new requests get 503" in output
    wait_for(lambda: len(worker_actors()) == actors_before, 30)  # its actors went with it


def test_a_lost_node_takes_only_its_workers_with_it(ray_cluster: TwoNodes, client: EngineClient) -> None:
    """Node 1 (the decode worker's) goes away: the prefill worker on node 0 stays ready, the
    decode worker waits for a node with its resource, and serves again once one joins.
    Last in the module: it replaces the cluster's second node."""
    request = {"prompt": Q, "images": [gradient_image(44, 52, 9)]}
    (reference,) = run(client, "node-ref", [request], [LONG])
    (lost,) = ray_cluster.cluster.worker_nodes
    ray_cluster.cluster.remove_node(lost, allow_graceful=False)
    wait_for(lambda: client.health()["workers"]["decode0"] != "ready", 60)
    assert client.health()["workers"]["prefill0"] == "ready"
    state = client.submit("after-node-loss", client.inputs.process(request), LONG)  # waits for a decode worker
    ray_cluster.cluster.add_node(**ray_cluster.second_node_args)
    assert state.wait(120) and state.error is None and state.token_ids == reference.token_ids
    assert_all_free(client)
