"""The discrete-event simulator against queueing theory and hand-worked timelines."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from mm_serve.ground.slo import SLO
from mm_serve.planner.colocated_instance import MixedSteps
from mm_serve.planner.latency_model import DecodeTiming, PrefillTiming
from mm_serve.planner.running_set import RunningSet
from mm_serve.planner.sim_request import NEVER, SimRequest
from mm_serve.planner.sim_result import SimResult
from mm_serve.planner.simulator import (
    DecodeServer,
    Handoff,
    PrefillServer,
    build_requests,
    simulate_colocated,
    simulate_decode,
    simulate_disaggregated,
    simulate_prefill,
)
from mm_serve.workloads import RequestSpec, poisson_arrivals


def fixed_prefill(seconds: float) -> PrefillTiming:
    """Every prefill batch takes ``seconds``, whatever it holds."""
    return PrefillTiming(1, seconds, 0, 0, 0, 0, 0, 0, 0)


def fixed_decode(seconds: float) -> DecodeTiming:
    """Every decode step takes ``seconds``."""
    return DecodeTiming(1, seconds, 0, 0, 0, 0)


def req(i: int, t: float, prompt: int, output: int) -> SimRequest:
    return SimRequest(i, t, prompt, output)


@pytest.mark.parametrize("load", [0.3, 0.6, 0.8])
def test_prefill_queue_matches_md1_mean_ttft(
    load: float, record_property: Callable[[str, object], None]
) -> None:
    """DistServe §3.1: one prefill instance, deterministic service time D, Poisson
    arrivals at rate R: mean TTFT = D + R D^2 / (2 (1 - R D))."""
    service, n = 0.1, 120_000
    rate = load / service
    reqs = build_requests([RequestSpec(512, 1)] * n, poisson_arrivals(n, rate, seed=0))
    result = simulate_prefill(PrefillServer(fixed_prefill(service), 1 << 20, 1), reqs)
    theory = service + rate * service**2 / (2 * (1 - rate * service))
    got = result.mean_ttft()
    line = (f"planner, M/D/1 at R*D={load}: simulated mean TTFT {got:.4f} s, theory {theory:.4f} s "
            f"({(got / theory - 1) * 100:+.1f} %)")
    print(line)
    record_property("figure", line)
    assert got == pytest.approx(theory, rel=0.05)


def test_prefill_batches_by_token_budget_fcfs() -> None:
    timing = PrefillTiming(1, 0.01, 1e-4, 0, 0, 0, 0, 0, 0)  # 10 ms + 0.1 ms per token
    reqs = [req(0, 0.0, 100, 1), req(1, 0.001, 300, 1), req(2, 0.002, 200, 1), req(3, 0.003, 50, 1)]
    simulate_prefill(PrefillServer(timing, 512, 8), reqs)
    # t=0: [0] alone (20 ms); t=0.02: [1, 2] (500 tokens <= 512), 60 ms; then [3], 15 ms
    assert [r.first_token_s for r in reqs] == pytest.approx([0.02, 0.08, 0.08, 0.095])


def test_pipelined_prefill_overlaps_batches() -> None:
    timing = PrefillTiming(2, 0.05, 0, 0, 0, 0, 0, 0.001, 0)  # 2 stages of 50 ms, 1 ms hop
    reqs = [req(0, 0.0, 10, 1), req(1, 0.0, 10, 1), req(2, 0.0, 10, 1)]
    simulate_prefill(PrefillServer(timing, 10, 1), reqs)
    assert [r.first_token_s for r in reqs] == pytest.approx([0.101, 0.151, 0.201])


def test_decode_continuous_batching_timeline() -> None:
    a, b = req(0, 0.0, 10, 4), req(1, 0.015, 10, 2)
    simulate_decode(DecodeServer(fixed_decode(0.01), 1000, 8), [a, b])
    # steps 0-10 ms and 10-20 ms run A alone; B joins at 20 ms; both end at 30 ms
    assert (a.finish_s, b.finish_s) == pytest.approx((0.03, 0.03))
    assert (a.tpot, b.tpot) == pytest.approx((0.01, 0.015))


def test_decode_waits_for_kv_capacity_and_drops_what_never_fits() -> None:
    a, b, huge = req(0, 0.0, 10, 4), req(1, 0.015, 10, 2), req(2, 0.016, 100, 2)
    simulate_decode(DecodeServer(fixed_decode(0.01), 20, 8), [a, b, huge])
    assert a.finish_s == pytest.approx(0.03)
    assert b.finish_s == pytest.approx(0.04)  # admitted when A released its 14 tokens
    assert b.decode_ready_s == pytest.approx(0.015)
    assert huge.finish_s == NEVER and huge.tpot == NEVER


def test_colocated_prefill_stalls_decode() -> None:
    a, b = req(0, 0.0, 10, 3), req(1, 0.02, 10, 2)
    simulate_colocated(fixed_prefill(0.05), DecodeServer(fixed_decode(0.01), 1000, 8), 4096, [a, b])
    assert (a.first_token_s, b.first_token_s) == pytest.approx((0.05, 0.10))
    assert (a.finish_s, b.finish_s) == pytest.approx((0.12, 0.11))
    assert (a.ttft, a.tpot, b.ttft, b.tpot) == pytest.approx((0.05, 0.035, 0.08, 0.01))


def test_colocated_mixed_steps_timeline() -> None:
    """Mixed steps of 64 tokens (Sarathi-Serve): prefill 10 ms + 0.1 ms a token + 1 us per
    squared-length unit, decode 4 ms + 1 ms a sequence. A's 100-token prompt goes in chunks of 64
    and 36; B's 40 tokens fill the rest of the second step (28) and the third (12, beside A's first
    decode, which adds its 1 ms but not the decode step's 4 ms constant); then one decode step of both."""
    a, b = req(0, 0.0, 100, 3), req(1, 0.001, 40, 2)
    prefill = PrefillTiming(1, 0.01, 1e-4, 1e-6, 0, 0, 0, 0, 0)
    decode = DecodeTiming(1, 0.004, 0.001, 0, 0, 0)
    simulate_colocated(prefill, DecodeServer(decode, 1000, 8), 4096, [a, b], mixed=MixedSteps(64))
    step1 = 0.01 + 64e-4 + 64**2 * 1e-6
    step2 = 0.01 + 64e-4 + ((100**2 - 64**2) + 28**2) * 1e-6
    step3 = 0.01 + 12e-4 + (40**2 - 28**2) * 1e-6 + 0.001
    assert a.first_token_s == pytest.approx(step1 + step2)
    assert b.first_token_s == pytest.approx(step1 + step2 + step3)
    assert a.finish_s == b.finish_s == pytest.approx(step1 + step2 + step3 + 0.006)
    # the chunks' squared-length units add up to the whole prompts' (100^2 + 40^2)
    assert 64**2 + (100**2 - 64**2) + 28**2 + (40**2 - 28**2) == 100**2 + 40**2


def test_colocated_mixed_steps_save_the_decode_pass_constant() -> None:
    """A decode step that is mostly its pass constant (10 ms of weights read, 1 ms a sequence) rides
    along prompts' passes for 1 ms a token: under a stream of 200-token prompts a running request's
    TPOT drops, while the prompts' TTFT pays only the decode rows; with a 10 ms prompt-pass constant
    the budget's chunks of one prompt in 2 passes cost one constant more than apart."""
    prefill = PrefillTiming(1, 0.01, 1e-4, 0, 0, 0, 0, 0, 0)
    decode = DecodeTiming(1, 0.01, 0.001, 0, 0, 0)
    results = {}
    for budget in (0, 256, 128):
        running = req(0, 0.0, 10, 30)
        prompts = [req(i, 0.005 + 0.04 * i, 200, 2) for i in range(1, 5)]
        simulate_colocated(prefill, DecodeServer(decode, 10_000, 8), 4096, [running, *prompts],
                           mixed=MixedSteps(budget) if budget else None)
        results[budget] = (running.tpot, max(r.ttft for r in prompts))
    assert results[256][0] < results[0][0]  # the fused steps save the decode constant
    assert results[256][1] <= results[0][1] + 0.003  # at most a few decode rows more per prompt
    assert results[128][1] > results[256][1] + 0.009  # two passes per prompt: one constant more


def test_colocated_mixed_steps_refuse_pipeline_stages() -> None:
    with pytest.raises(ValueError, match="pipeline"):
        simulate_colocated(PrefillTiming(2, 0.01, 0, 0, 0, 0, 0, 0, 0), DecodeServer(fixed_decode(0.01), 100, 8),
                           4096, [req(0, 0.0, 10, 2)], mixed=MixedSteps(64))
    with pytest.raises(ValueError, match=">= 1"):
        MixedSteps(64, max_prefill=0)


def test_colocated_mixed_steps_cap_the_requests_prefilling_and_take_a_page_past_the_decodes() -> None:
    """At most ``max_prefill`` requests prefill in one step (the engine's ``prefill_batch_size``): 5 prompts of
    10 tokens arriving together go 1 + 2 + 2 over three steps (the first starts a step on arriving); then, with
    2 requests decoding and a budget of 2, a late 40-token prompt still prefills a page (16 tokens) a step."""
    prefill = PrefillTiming(1, 0.01, 0, 0, 0, 0, 0, 0, 0)
    decode = DecodeTiming(1, 0.004, 0.001, 0, 0, 0)
    burst = [req(i, 0.0, 10, 2) for i in range(5)]
    simulate_colocated(prefill, DecodeServer(decode, 1000, 8), 4096, burst, mixed=MixedSteps(64, max_prefill=2))
    first = sorted({round(r.first_token_s, 6) for r in burst})
    assert len(first) == 3 and [sum(round(r.first_token_s, 6) == t for r in burst) for t in first] == [1, 2, 2]
    a, b, late = req(0, 0.0, 10, 6), req(1, 0.0, 10, 6), req(2, 0.001, 40, 2)
    simulate_colocated(prefill, DecodeServer(decode, 1000, 8), 4096, [a, b, late],
                       mixed=MixedSteps(2, max_prefill=8, page_size=16))
    # step 1 (10 ms): a alone (it started the step on arriving); step 2: b's 10 tokens and late's first 6 beside
    # a's decode (11 ms); steps 3-5: late's 16 + 16 + 2 tokens beside 2 decodes (12 ms each)
    assert late.first_token_s == pytest.approx(0.01 + 0.011 + 3 * 0.012)
    assert b.first_token_s == pytest.approx(0.021)


def test_disaggregated_handoff_and_shortest_queue() -> None:
    a, b = req(0, 0.0, 10, 20), req(1, 0.01, 10, 2)
    result = simulate_disaggregated(
        [PrefillServer(fixed_prefill(0.05), 4096, 8)],
        [DecodeServer(fixed_decode(0.01), 1000, 8)] * 2,
        [[Handoff(0.001, 0.0), Handoff(0.001, 0.0)]],
        [a, b],
    )
    assert (a.first_token_s, b.first_token_s) == pytest.approx((0.05, 0.10))
    assert a.decode_ready_s == pytest.approx(0.051) and a.finish_s == pytest.approx(0.051 + 19 * 0.01)
    assert b.decode_ready_s == pytest.approx(0.101) and b.finish_s == pytest.approx(0.111)  # decode 1
    slo = SLO(ttft_s=0.06, tpot_s=0.02)
    assert result.attainment(slo, "prefill") == 0.5  # B waited behind A's prefill
    assert result.attainment(slo, "decode") == 1.0
    assert result.attainment(slo) == 0.5


def test_running_set_invariants_under_random_load() -> None:
    rng = random.Random(7)
    rs = RunningSet(kv_capacity=5000, max_batch=16)
    reqs = [req(i, 0.0, rng.randint(1, 400), rng.randint(1, 300)) for i in range(300)]
    pending, done = list(reqs), 0
    while pending or len(rs):
        while pending and rs.fits(pending[0]):
            if not rs.add(pending.pop(0)):
                done += 1
        rs.check()
        done += len(rs.finish_step())
        rs.check()
    assert done == 300 and rs.reserved_kv == 0 and rs.context == 0


def test_sim_result_metrics() -> None:
    reqs = [req(i, 0.0, 1, 3) for i in range(10)]
    for i, r in enumerate(reqs):
        r.first_token_s = 0.1 * (i + 1)
        r.finish_s = r.first_token_s + 0.2
    res = SimResult(reqs)
    assert res.mean_ttft() == pytest.approx(0.55)
    assert res.mean_tpot() == pytest.approx(0.1)
    assert res.percentile("ttft", 0.9) == pytest.approx(0.9)
    assert res.attainment(SLO(0.45, 1.0)) == 0.4
    assert res.attainment(SLO(0.45, 1.0), skip=5) == 0.0
    with pytest.raises(ValueError, match="SLOs must be > 0"):
        SLO(0.0, 1.0)


def stepwise_decode(timing: DecodeTiming, kv_capacity: int, max_batch: int,
                    reqs: list[SimRequest]) -> list[float]:
    """Oracle: one decode instance stepped one step at a time, written plainly
    (FCFS admission at step boundaries; an arrival at a boundary joins it)."""
    pending = sorted(reqs, key=lambda r: r.arrival_s)
    waiting: list[SimRequest] = []
    running: dict[int, list[int]] = {}  # index -> [tokens left, context]
    finish = {r.index: NEVER for r in reqs}
    t, reserved = 0.0, 0
    while pending or waiting or running:
        if not running and not waiting:
            t = max(t, pending[0].arrival_s)
        while pending and pending[0].arrival_s <= t:
            waiting.append(pending.pop(0))
        while waiting:
            head = waiting[0]
            if head.final_context > kv_capacity:
                waiting.pop(0)
                continue
            if len(running) >= max_batch or reserved + head.final_context > kv_capacity:
                break
            waiting.pop(0)
            if head.output_tokens == 1:
                finish[head.index] = t
                continue
            reserved += head.final_context
            running[head.index] = [head.output_tokens - 1, head.prompt_tokens + 1]
        if not running:
            continue
        t += timing.step_time(len(running), sum(c for _, c in running.values()))
        for i, state in list(running.items()):
            state[0] -= 1
            state[1] += 1
            if state[0] == 0:
                finish[i] = t
                reserved -= state[1]  # = prompt + output, its final context
                del running[i]
    return [finish[r.index] for r in reqs]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_step_runs_match_stepping_one_step_at_a_time(seed: int) -> None:
    """The simulator runs decode steps a run at a time (one event per unchanged batch,
    cut when a request may join); per-request finish times must equal the plain
    one-step-at-a-time schedule, under KV pressure and arrivals mid-run."""
    rng = random.Random(seed)
    timing = DecodeTiming(2, 0.004, 1e-4, 2e-6, 1e-4, 1e-6)  # pipelined, context-dependent
    t, reqs = 0.0, []
    for i in range(400):
        t += rng.expovariate(40.0)
        reqs.append(req(i, t, rng.randint(1, 600), rng.choice([1, 2, rng.randint(3, 300)])))
    reqs.append(req(400, t, 5000, 10))  # never fits
    expected = stepwise_decode(timing, 4000, 24, [req(r.index, r.arrival_s, r.prompt_tokens,
                                                      r.output_tokens) for r in reqs])
    simulate_decode(DecodeServer(timing, 4000, 24), reqs)
    assert sum(f < NEVER for f in expected) == 400
    assert [r.finish_s for r in reqs] == pytest.approx(expected, rel=1e-12)


def test_colocated_dispatch_counts_waiting_and_running_requests() -> None:
    """The colocated pool's dispatcher counts requests waiting or decoding, not the
    prefill batch under way (the stronger rule for the baseline, see
    ``ColocatedInstance``): B finds both replicas at 0 and joins replica 0 behind
    A's prefill; C, arriving while B waits there, goes to replica 1."""
    a, b, c = req(0, 0.0, 10, 2), req(1, 0.01, 10, 2), req(2, 0.02, 10, 2)
    simulate_colocated(fixed_prefill(0.05), DecodeServer(fixed_decode(0.01), 1000, 8), 4096,
                       [a, b, c], replicas=2)
    assert (a.first_token_s, b.first_token_s, c.first_token_s) == pytest.approx((0.05, 0.10, 0.07))


def test_running_set_accounts_runs_of_steps() -> None:
    rs = RunningSet(kv_capacity=1000, max_batch=8)
    rs.add(req(0, 0.0, 10, 5))  # 4 steps left
    rs.add(req(1, 0.0, 20, 3))  # 2 steps left
    assert rs.steps_to_next_finish() == 2
    with pytest.raises(ValueError, match="cannot account 3 steps"):
        rs.finish_steps(3)
    assert [r.index for r in rs.finish_steps(2)] == [1]
    assert (rs.steps_to_next_finish(), rs.context) == (2, 11 + 2)
    rs.check()


def test_gc_paused_restores_the_collector_state() -> None:
    import gc

    from mm_serve.planner.events import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block does not re-enable it
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # left as found
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()
