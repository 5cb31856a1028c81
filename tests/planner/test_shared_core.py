"""The shared-core placement's model: CFS shares, paced decode steps, the prefill worker's slowdown,
and a hand-worked timeline of a prefill instance beside a paced decode instance."""

from __future__ import annotations

import pytest

from mm_serve.planner.latency_model import DecodeTiming, PrefillTiming
from mm_serve.planner.shared_core import (
    PacedDecodeTiming,
    SharedCorePlacement,
    cfs_share,
    cfs_weight,
    prefill_slowdown,
)
from mm_serve.planner.sim_request import SimRequest
from mm_serve.planner.simulator import DecodeServer, Handoff, PrefillServer, simulate_disaggregated


def paced(step_s: float, interval_s: float, share: float = 0.75) -> PacedDecodeTiming:
    """A decode step of ``step_s`` alone, whatever the batch, paced at ``interval_s``."""
    return PacedDecodeTiming(1, step_s, 0, 0, 0, 0, interval_s=interval_s, share=share)


def test_cfs_shares_follow_the_kernels_weights() -> None:
    """sched_prio_to_weight: nice 0 is 1024, nice 5 is 335, nice 10 is 110 (each level ~1.25x)."""
    assert cfs_weight(0) == 1024 and cfs_weight(5) == pytest.approx(335, abs=1) and cfs_weight(10) == pytest.approx(110, abs=1)
    assert cfs_share(5, 5) == 0.5
    assert cfs_share(5, 10) == pytest.approx(335.54 / (335.54 + 109.95), abs=1e-4)  # 0.753
    assert cfs_share(0, 19) == pytest.approx(0.986, abs=1e-3)


def test_a_paced_step_takes_the_interval_or_its_work_over_its_share() -> None:
    assert paced(0.01, 0.05).step_ends(1.0, 4, 100, 3) == pytest.approx([1.05, 1.10, 1.15])
    assert paced(0.01, 0.0).step_ends(0.0, 4, 100, 2) == pytest.approx([0.01 / 0.75, 0.02 / 0.75])  # unpaced
    assert paced(0.01, 0.012).step_ends(0.0, 4, 100, 1) == pytest.approx([0.01 / 0.75])  # 13.3 ms > 12 ms
    # the work grows with the context: each step is priced at its own context, as one step at a time
    growing = PacedDecodeTiming(1, 0.001, 0.0, 0.001, 0, 0, interval_s=0.0, share=0.5)
    assert growing.step_ends(0.0, 2, 10, 2) == pytest.approx([2 * 0.011, 2 * 0.011 + 2 * 0.013])
    assert paced(0.01, 0.05).min_step_time(100) == 0.05 and paced(0.01, 0.0).min_step_time(100) == 0.01
    assert paced(0.01, 0.05).alone(8, 100) == 0.01


def test_the_prefill_worker_gets_what_the_decode_worker_leaves() -> None:
    """Per interval the decode worker takes its step's work, the prefill worker the rest; steps back to back
    leave it 1 - share; never less than 5 %."""
    assert prefill_slowdown(paced(0.01, 0.05), 0, 0) == 1.0  # nothing decoding
    assert prefill_slowdown(paced(0.01, 0.05), 4, 400) == pytest.approx(1 / 0.8)
    assert prefill_slowdown(paced(0.01, 0.0), 4, 400) == pytest.approx(4.0)  # unpaced: 1 / (1 - 0.75)
    assert prefill_slowdown(paced(0.01, 0.012), 4, 400) == pytest.approx(4.0)  # 1 - 10/12 < 1 - 0.75
    assert prefill_slowdown(paced(0.01, 0.01, share=0.99), 4, 400) == pytest.approx(20.0)  # the 5 % floor


def test_a_prefill_on_the_shared_core_is_slowed_while_the_decode_worker_runs() -> None:
    """Two prefill instances (50 ms a batch), the second on the decode instance's core; the decode steps
    take 10 ms of work, paced at 50 ms. A is prefilled on core 0 alone, then decodes every 50 ms; B and C
    arrive together at 60 ms: B goes to prefill 0 (50 ms), C to the shared one, where the decode worker's
    duty of 10/50 leaves 80 % of the core: 62.5 ms."""
    prefill = PrefillServer(PrefillTiming(1, 0.05, 0, 0, 0, 0, 0, 0, 0), 4096, 1)
    decode = DecodeServer(paced(0.01, 0.05), 10_000, 8)
    a, b, c = SimRequest(0, 0.0, 10, 4), SimRequest(1, 0.06, 10, 2), SimRequest(2, 0.06, 10, 2)
    link = Handoff(0.001, 0.0)
    simulate_disaggregated([prefill, prefill], [decode], [[link], [link]], [a, b, c], shared=(1, 0))
    assert a.first_token_s == pytest.approx(0.05) and a.finish_s == pytest.approx(0.051 + 3 * 0.05)
    assert b.first_token_s == pytest.approx(0.11)
    assert c.first_token_s == pytest.approx(0.06 + 0.05 / 0.8)
    a2, b2, c2 = SimRequest(0, 0.0, 10, 4), SimRequest(1, 0.06, 10, 2), SimRequest(2, 0.06, 10, 2)
    simulate_disaggregated([prefill, prefill], [decode], [[link], [link]], [a2, b2, c2])  # no shared core
    assert c2.first_token_s == pytest.approx(0.11)
    with pytest.raises(ValueError, match="PacedDecodeTiming"):
        simulate_disaggregated([prefill], [DecodeServer(DecodeTiming(1, 0.01, 0, 0, 0, 0), 100, 8)], [[link]],
                               [SimRequest(0, 0.0, 10, 2)], shared=(0, 0))


def test_the_placement_names_its_pacing() -> None:
    assert SharedCorePlacement(2, 0.7).name == "2P+1D shared core (paced 0.7)"
    assert SharedCorePlacement(4, 0.0).name == "4P+1D shared core (unpaced)"
