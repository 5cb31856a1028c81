"""Supervision rules and ring generations without a model: real processes, real segments, exact values."""

from __future__ import annotations

import os
import subprocess
import sys

from mm_serve.cluster import supervision
from mm_serve.cluster.ring_generations import RingGenerations
from mm_serve.cluster.worker_state import WorkerRecord, WorkerStatus, health_report
from mm_serve.config import FaultConfig
from mm_serve.ground.roles import Role
from mm_serve.runtime.engine_config import EngineConfig
from mm_serve.runtime.worker_spec import WorkerSpec
from mm_serve.transport.ring_spec import RingSpec, unique_ring_name

FAULT = FaultConfig(heartbeat_timeout_s=10.0, max_restarts=3, restart_window_s=300.0, restart_backoff_s=0.5,
                    start_timeout_s=60.0)


def record(role: str = "decode") -> WorkerRecord:
    return WorkerRecord(WorkerSpec(role=role, index=0, model_dir="", sizing=EngineConfig(), control_address="",
                                   output_address=""))


def python(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code])


def test_a_role_string_becomes_the_role() -> None:
    assert record("prefill").spec.role is Role.PREFILL and Role.PREFILL.hands_off and not Role.COLOCATED.hands_off


def test_exits_hangs_and_slow_starts_are_failures() -> None:
    worker = record()
    assert supervision.failure_reason(worker, 0.0, FAULT) is None  # not started
    worker.process = python("raise SystemExit(3)")
    worker.process.wait()
    assert supervision.failure_reason(worker, 0.0, FAULT) == "exited with code 3"
    worker.process = python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    worker.process.wait()
    assert supervision.failure_reason(worker, 0.0, FAULT) == (  # what the out-of-memory killer leaves
        "exited with code -9, killed by SIGKILL (when nothing else sent it, the kernel's out-of-memory killer: "
        "see `dmesg`)")
    worker.process = python("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    worker.process.wait()
    assert supervision.failure_reason(worker, 0.0, FAULT) == "exited with code -11, killed by SIGSEGV"
    worker.process = python("import time; time.sleep(60)")
    try:
        worker.status, worker.last_seen = WorkerStatus.READY, 100.0
        assert supervision.failure_reason(worker, 110.0, FAULT) is None
        assert supervision.failure_reason(worker, 110.25, FAULT) == (
            "hung: no heartbeat for 10.2 s (fault.heartbeat_timeout_s)")
        worker.status, worker.started_at = WorkerStatus.RESTARTING, 100.0
        assert supervision.failure_reason(worker, 161.0, FAULT) == (
            "not ready 61 s after its restart (fault.start_timeout_s)")
    finally:
        process = worker.process
        supervision.stop_failed(worker)
    assert worker.process is None and process.returncode == -9


def test_back_off_doubles_then_the_worker_stays_down() -> None:
    worker = record()
    delays = []
    for now in (1000.0, 1001.0, 1002.0):
        supervision.plan_restart(worker, "exited with code 1", now, FAULT)
        assert worker.status is WorkerStatus.RESTARTING and worker.restart_at is not None
        delays.append(worker.restart_at - now)
        notice = supervision.failure_notice(("decode", 0), worker, now, FAULT, True)
        worker.restarts.append(worker.restart_at)  # as the pool does when it starts it again
    assert delays == [0.5, 1.0, 2.0]
    assert notice == (
        "mm-serve: decode worker 0 exited with code 1; restarting it in 2.0 s (restart 3 of 3 allowed in 300 s)")
    supervision.plan_restart(worker, "exited with code 1", 1003.0, FAULT)
    assert worker.status is WorkerStatus.DOWN and worker.restart_at is None
    assert supervision.failure_notice(("decode", 0), worker, 1003.0, FAULT, False) == (
        "mm-serve: decode worker 0 exited with code 1; it stays down (3 restarts within "
        "fault.restart_window_s = 300 s); no decode worker is left: requests get 503")
    supervision.plan_restart(worker, "exited with code 1", 1400.0, FAULT)  # the window has passed
    assert worker.status is WorkerStatus.RESTARTING and worker.restart_at == 1400.5
    assert health_report({(Role.DECODE, 0): worker}, serving=False) == {
        "status": "down", "workers": {"decode0": "restarting"}, "faults": {"decode0": "exited with code 1"}}


def segments(prefix: str) -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(prefix))


def test_a_restarted_prefill_worker_gets_fresh_rings_and_a_loading_peer_keeps_the_old() -> None:
    base = unique_ring_name("gen")
    specs = [RingSpec(name=f"{base}-p{p}d{d}", num_pages=4, page_shape=(1, 2, 4, 1, 2), dtype="float32",
                      feature_rows=0, feature_dim=4, capacity=2, max_pages_per_handoff=2, meta_bytes=8)
             for p in range(2) for d in range(2)]
    rings = RingGenerations(specs, num_decode=2)
    try:
        assert len(rings.rings) == 4 and rings.transports() == ["shm"] * 4
        loading = {(Role.DECODE, 1)}
        fresh, swaps = rings.renew((Role.PREFILL, 1), lambda spec, p, d: spec, lambda peer: peer in loading)
        assert [s.name for s in fresh] == [f"{base}-p1d0-r1", f"{base}-p1d1-r1"]
        assert [(s.peer, s.message.peer_index, s.message.ring.name) for s in swaps] == [
            ((Role.DECODE, 0), 1, f"{base}-p1d0-r1"), ((Role.DECODE, 1), 1, f"{base}-p1d1-r1")]
        assert [s.name for s in rings.specs] == [f"{base}-p0d0", f"{base}-p0d1", f"{base}-p1d0-r1", f"{base}-p1d1-r1"]
        kept = {f"{base}-p1d1-{part}" for part in ("ctl", "kv", "feat")}  # decode 1 is loading
        gone = {f"{base}-p1d0-{part}" for part in ("ctl", "kv", "feat")}  # decode 0 is not
        assert kept <= set(segments(base)) and not gone & set(segments(base))
        again, _ = rings.renew((Role.DECODE, 0), lambda spec, p, d: spec, lambda peer: False)
        assert [s.name for s in again] == [f"{base}-p0d0-r2", f"{base}-p1d0-r2"]
        rings.release((Role.DECODE, 1))  # ready: the old ring it may have attached goes
        assert not kept & set(segments(base))
    finally:
        rings.close()
    assert segments(base) == []
