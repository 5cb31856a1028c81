"""Supervision, restart and request migration: real workers killed, stopped and fed bad hand-offs.

Every test compares against the same requests run without the fault on the same
service: greedy and seeded streams must come out token for token the same, and
every page, ring slot and segment must be back where it was.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from mm_serve import LLM
from mm_serve.config import ConfigError, config_from_dict
from mm_serve.engine.engine_client import EngineClient
from mm_serve.engine.request_state import RequestState
from mm_serve.runtime.sampling_params import SamplingParams
from tests.factories import gradient_image
from tests.test_disaggregation import shm_segments

LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=200, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
# every logit adjustment at once; min_tokens runs past the kill below, so the migrated attempt keeps the rest of it
PENALIZED = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, min_tokens=30, stop_token_ids=(6,),
                           logit_bias=((5, 1.5), (6, 4.0)), repetition_penalty=1.3, frequency_penalty=0.4,
                           presence_penalty=0.2)


def make_client(model: Path, **overrides: Any) -> EngineClient:
    base = {"kv_cache": {"max_pages_per_gpu": 256}, "fault": {"heartbeat_timeout_s": 2.0, "restart_backoff_s": 0.1}}
    client = EngineClient(model, config_from_dict(base, overrides))
    client.start()
    return client


def checked_shutdown(c: EngineClient) -> None:
    prefix = f"mmsrv-{c.pool.instance}"
    c.shutdown()
    assert shm_segments(prefix) == [], "every ring segment, old and new, is unlinked"
    assert not c.pool.run_dir.exists()


@pytest.fixture(scope="module")
def shared(tiny_llava: Path) -> Iterator[EngineClient]:
    """One 1P1D service for the tests that leave it clean (counters are compared as deltas)."""
    c = make_client(tiny_llava, **{"fault.max_restarts": 10})
    try:
        yield c
    finally:
        checked_shutdown(c)


@pytest.fixture
def client(tiny_llava: Path, request: pytest.FixtureRequest) -> Iterator[EngineClient]:
    """A service of its own, for the tests whose config differs."""
    c = make_client(tiny_llava, **request.param)
    try:
        yield c
    finally:
        checked_shutdown(c)


class Counts:
    """Fault counters since construction."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.start = client.fault_report()[0]

    def __getitem__(self, key: tuple[str, str]) -> int:
        return self.client.fault_report()[0].get(key, 0) - self.start.get(key, 0)


def image_request(client: EngineClient, i: int) -> Any:
    return client.inputs.process({"prompt": f"Describe <image> number {i} in detail",
                                  "images": [gradient_image(40 + i, 36, i)]})


def wait_tokens(state: RequestState, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(state.token_ids) < n and not state.finished:
        assert time.monotonic() < deadline, "no tokens arrived"
        time.sleep(0.0005)


def wait_for(predicate: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def assert_clean(client: EngineClient) -> None:
    """No page used on any worker, no ring slot held, every ring page free, every worker ready."""
    wait_for(lambda: client.health()["status"] == "ok")
    time.sleep(0.3)  # a pump or two on the prefill side reclaims released ring pages
    stats = client.query_stats()
    assert set(stats) == set(client.pool.keys)
    for key, s in stats.items():
        assert (s.kv_pages_used, s.ring_slots_used, s.pages_integrity_ok) == (0, 0, True), key
    assert [r.pages_free() for r in client.pool.rings] == [r.spec.num_pages for r in client.pool.rings]


def assert_decode_kill_migrates(model: Path, request: dict[str, Any], params: SamplingParams, expected: list[int],
                                after_tokens: int = 5) -> None:
    """On a fresh 1P1D service of ``model``: submit ``request``, SIGKILL the decode worker once ``after_tokens``
    tokens have streamed; the request migrates once and ends with ``expected``, and nothing is left held
    (:func:`assert_clean`, :func:`checked_shutdown`)."""
    client = make_client(model)
    try:
        state = client.submit(new_id("decode-kill"), client.inputs.process(request), params)
        wait_tokens(state, after_tokens)
        os.kill(client.pool.workers[("decode", 0)].pid, signal.SIGKILL)
        assert state.wait(120)
        assert state.error is None and state.token_ids == expected
        assert client.fault_report()[0].get(("request_migrations", "decode"), 0) == 1
        assert_clean(client)
    finally:
        checked_shutdown(client)


def new_id(tag: str) -> str:
    """Ids are never reused on the shared service: a late update of an old request must not match."""
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def run_all(client: EngineClient, tag: str, inputs: list[Any], params: SamplingParams) -> list[RequestState]:
    states = [client.submit(new_id(f"{tag}{i}"), x, params) for i, x in enumerate(inputs)]
    for s in states:
        assert s.wait(120)
    return states


@pytest.mark.parametrize("params", [LONG, SEEDED, PENALIZED], ids=["greedy", "seeded", "penalized"])
def test_decode_killed_mid_stream_continues_token_for_token(shared: EngineClient, params: SamplingParams) -> None:
    client, counts = shared, Counts(shared)
    inputs = image_request(client, 1)
    (reference,) = run_all(client, "ref", [inputs], params)
    state = client.submit(new_id("x"), inputs, params)
    wait_tokens(state, 20)
    os.kill(client.pool.workers[("decode", 0)].pid, signal.SIGKILL)
    assert state.wait(120)
    assert state.error is None and state.token_ids == reference.token_ids and state.text == reference.text
    if params is PENALIZED:  # the stop token, pushed up by its bias, ends the output once min_tokens allows
        assert 30 < len(state.token_ids) < 200 and 6 not in state.token_ids[:30] and state.token_ids[-1] == 6
        assert state.finish_reason == "stop"
    else:
        assert 20 <= len(state.token_ids) == 200 and state.finish_reason == "length"
    assert counts[("request_migrations", "decode")] == 1 and counts[("worker_restarts", "decode")] == 1
    assert state.delayed_by_fault and not reference.delayed_by_fault  # admission learns nothing from it
    assert_clean(client)


def test_logit_adjustments_give_the_colocated_engine_s_tokens(shared: EngineClient, tiny_llava: Path) -> None:
    """Greedy with every logit adjustment (``PENALIZED`` with a later stop token): the disaggregated service (the
    first token sampled on the prefill worker, the rest on the decode worker) gives the colocated engine's
    tokens, and the adjustments change them."""
    params = replace(PENALIZED, stop_token_ids=(), logit_bias=((5, 1.5),), max_tokens=80)
    plain = replace(params, min_tokens=0, logit_bias=(), repetition_penalty=1.0, frequency_penalty=0.0,
                    presence_penalty=0.0)
    request = {"prompt": "Describe <image> number 1 in detail", "images": [gradient_image(41, 36, 1)]}
    (adjusted,) = run_all(shared, "adjusted", [shared.inputs.process(request)], params)
    (unadjusted,) = run_all(shared, "plain", [shared.inputs.process(request)], plain)
    (colocated,) = LLM(tiny_llava, mode="colocated").generate([request], params)
    assert colocated.token_ids == adjusted.token_ids and len(colocated.token_ids) == 80
    assert unadjusted.token_ids != adjusted.token_ids


def test_prefill_killed_with_a_queue_loses_nothing(shared: EngineClient) -> None:
    client, counts = shared, Counts(shared)
    inputs = [image_request(client, i) for i in range(10)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    reference = run_all(client, "ref", inputs, params)
    states = [client.submit(new_id(f"x{i}"), x, params) for i, x in enumerate(inputs)]
    wait_tokens(states[0], 1)
    os.kill(client.pool.workers[("prefill", 0)].pid, signal.SIGKILL)
    for s in states:
        assert s.wait(120)
    assert [s.error for s in states] == [None] * 10
    assert [s.token_ids for s in states] == [r.token_ids for r in reference]
    assert counts[("worker_restarts", "prefill")] == 1
    assert counts[("request_migrations", "prefill")] >= 1  # those still queued or not yet taken by decode
    # the moved ones (and any parked while the worker restarted) are marked: admission learns nothing from them
    assert sum(s.delayed_by_fault for s in states) >= counts[("request_migrations", "prefill")]
    assert_clean(client)


def test_hung_decode_worker_is_detected_and_replaced(shared: EngineClient) -> None:
    client = shared
    inputs = image_request(client, 2)
    (reference,) = run_all(client, "ref", [inputs], LONG)
    old_pid = client.pool.workers[("decode", 0)].pid
    state = client.submit(new_id("x"), inputs, LONG)
    wait_tokens(state, 10)
    stopped_at = time.monotonic()
    os.kill(old_pid, signal.SIGSTOP)
    wait_for(lambda: client.health()["workers"]["decode0"] != "ready", 10)
    assert 2.0 <= time.monotonic() - stopped_at < 5.0, "found within the heartbeat timeout (+ one check)"
    assert "hung" in client.health()["faults"]["decode0"]
    assert state.wait(120) and state.error is None and state.token_ids == reference.token_ids
    assert client.pool.workers[("decode", 0)].pid != old_pid
    with pytest.raises(ProcessLookupError):
        os.kill(old_pid, 0)  # the stopped process was killed, not left behind
    assert_clean(client)


def test_peer_dies_while_the_other_restarts(shared: EngineClient) -> None:
    """Decode dies while the restarted prefill still loads (it may attach the rings decode's
    restart replaces): each comes back once, no cascade of start failures, output exact."""
    client, counts = shared, Counts(shared)
    inputs = image_request(client, 7)
    (reference,) = run_all(client, "ref", [inputs], LONG)
    os.kill(client.pool.workers[("prefill", 0)].pid, signal.SIGKILL)
    wait_for(lambda: client.pool.workers[("prefill", 0)].process is not None
             and client.pool.status(("prefill", 0)).value == "restarting", 20)  # spawned, loading
    os.kill(client.pool.workers[("decode", 0)].pid, signal.SIGKILL)
    state = client.submit(new_id("x"), inputs, LONG)  # waits for both
    assert state.wait(120) and state.error is None and state.token_ids == reference.token_ids
    assert_clean(client)
    assert counts[("worker_restarts", "prefill")] == 1 and counts[("worker_restarts", "decode")] == 1


@pytest.mark.parametrize("corrupt", ["version", "checksum"])
def test_bad_handoff_is_recomputed_not_served(shared: EngineClient, corrupt: str) -> None:
    client, counts = shared, Counts(shared)
    inputs = image_request(client, 3)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    (reference,) = run_all(client, "ref", [inputs], params)
    decode_pid = client.pool.workers[("decode", 0)].pid
    ring = client.pool.rings[0]
    os.kill(decode_pid, signal.SIGSTOP)  # hold the hand-off in the ring while it is corrupted
    try:
        state = client.submit(new_id("x"), inputs, params)
        wait_for(lambda: ring.slots_used() == 1, 20)
        handoff = ring.peek()
        assert handoff is not None and handoff.request_id == state.request_id
        if corrupt == "version":
            ring._slots["version"][handoff.seq % ring.spec.capacity] += 7
        else:
            ring.pages[handoff.page_ids[0]].view(-1)[0] += 1.0
    finally:
        os.kill(decode_pid, signal.SIGCONT)
    assert state.wait(120) and state.error is None
    assert state.token_ids == reference.token_ids
    assert counts[("handoff_failures", "decode")] == 1 and counts[("request_migrations", "decode")] == 1
    assert counts[("worker_restarts", "decode")] == 0, "a bad hand-off is no reason to restart"
    assert_clean(client)


@pytest.mark.parametrize("client", [{"fault.max_migrations": 0}], indirect=True)
def test_past_max_migrations_the_request_fails_with_the_fault(client: EngineClient) -> None:
    state = client.submit(new_id("x"), image_request(client, 4), LONG)
    wait_tokens(state, 5)
    os.kill(client.pool.workers[("decode", 0)].pid, signal.SIGKILL)
    assert state.wait(60)
    assert state.finish_reason == "error" and state.error is not None
    assert "decode worker 0 exited with code -9" in state.error and "fault.max_migrations = 0" in state.error
    assert client.fault_report()[0][("requests_failed_by_fault", "decode")] == 1
    assert_clean(client)


@pytest.mark.parametrize("client", [{"fault.max_restarts": 0, "compute.decode_workers": 2}], indirect=True)
def test_worker_past_its_restarts_stays_down_and_the_rest_serve(client: EngineClient) -> None:
    inputs = image_request(client, 5)
    (reference,) = run_all(client, "ref", [inputs], LONG)
    states = [client.submit(new_id(f"x{i}"), inputs, LONG) for i in range(4)]
    wait_tokens(states[0], 5)
    os.kill(client.pool.workers[("decode", 1)].pid, signal.SIGKILL)
    for s in states:
        assert s.wait(120) and s.error is None and s.token_ids == reference.token_ids
    health = client.health()
    assert health["status"] == "degraded" and health["workers"]["decode1"] == "down"
    later = run_all(client, "later", [inputs] * 3, LONG)  # routed to decode 0 only
    assert all(s.token_ids == reference.token_ids for s in later)


def test_colocated_worker_killed_mid_stream(tiny_llava: Path) -> None:
    client = make_client(tiny_llava, mode="colocated")
    try:
        inputs = image_request(client, 6)
        (reference,) = run_all(client, "ref", [inputs], SEEDED)
        state = client.submit(new_id("x"), inputs, SEEDED)
        wait_tokens(state, 20)
        os.kill(client.pool.workers[("colocated", 0)].pid, signal.SIGKILL)
        assert state.wait(120) and state.error is None and state.token_ids == reference.token_ids
        wait_for(lambda: client.health()["status"] == "ok")
    finally:
        client.shutdown()


@pytest.mark.parametrize("bad", [{"max_restarts": True}, {"restart_backoff_s": "0.5"}, {"handoff_checksum": "no"},
                                 {"heartbeat_timeout_s": 0.1}, {"max_migrations": -1}])
def test_fault_keys_are_strict(bad: dict[str, Any]) -> None:
    (key,) = bad
    with pytest.raises(ConfigError, match=f"fault.{key} = "):
        config_from_dict({"fault": bad})
