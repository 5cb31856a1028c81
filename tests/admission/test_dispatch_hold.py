"""The batch tier is queued, not refused: the dispatch hold and the rule that lets a call go."""

from __future__ import annotations

import asyncio

import pytest

from mm_serve.admission.controller import AdmissionController
from mm_serve.admission.dispatch_hold import DispatchHold
from mm_serve.config import load_config
from mm_serve.engine.load_ledger import LoadLedger
from mm_serve.engine.load_view import LoadView, Route
from mm_serve.ground.tiers import Tier


class _Client:
    """The one method of EngineClient the controller uses here, over a real LoadLedger."""

    def __init__(self, router: LoadLedger) -> None:
        self.router = router

    def load_view(self, tier: Tier, num_tokens: int, max_tokens: int) -> LoadView:
        return self.router.view(tier, Route(0, 0))


def _cfg(**overrides: object):  # type: ignore[no-untyped-def]
    return load_config(None, {"slo.tiers.interactive": {"ttft_ms": 1000, "tpot_ms": 20},
                              "slo.tiers.standard": {"ttft_ms": 4000, "tpot_ms": 200}, "admission.margin": 0.0,
                              "scheduler.prefill_batch_size": 2, **overrides})


def test_a_batch_request_waits_while_tighter_work_is_queued_on_its_prefill_worker() -> None:
    cfg = _cfg()
    controller = AdmissionController(cfg)
    router = LoadLedger(1, 1, 1000)
    client = _Client(router)
    batch, standard = Tier.BATCH, Tier.STANDARD
    assert controller.holds(batch) and not controller.holds(standard)
    assert controller.hold_reason(client, batch, 100, 0, 16) is None  # type: ignore[arg-type]
    router.dispatched("s", 0, 0, 500, 1, tier=Tier(1))
    reason = controller.hold_reason(client, batch, 100, 0, 16)  # type: ignore[arg-type]
    assert reason is not None and "1 tighter request(s) queued on prefill worker 0" in reason
    router.prefilled("s")  # its first token came back: the prefill queue is empty again
    router.finished("s")
    assert controller.hold_reason(client, batch, 100, 0, 16) is None  # type: ignore[arg-type]


def test_a_batch_request_waits_while_a_prefill_batch_of_its_tier_is_already_queued() -> None:
    cfg = _cfg()  # prefill_batch_size 2
    controller = AdmissionController(cfg)
    router = LoadLedger(1, 1, 1000)
    client = _Client(router)
    batch = Tier.BATCH
    router.dispatched("b1", 0, 0, 100, 1, tier=Tier(2))
    assert controller.hold_reason(client, batch, 100, 0, 16) is None  # type: ignore[arg-type]
    router.dispatched("b2", 0, 0, 100, 1, tier=Tier(2))
    assert "prefill batch of looser requests" in (controller.hold_reason(client, batch, 100, 0, 16) or "")  # type: ignore[arg-type]


def test_a_batch_request_waits_while_it_would_slow_a_tighter_decode_past_its_tpot_slo() -> None:
    cfg = _cfg()
    controller = AdmissionController(cfg)
    for _ in range(50):  # 30 ms decode steps: over interactive's 20 ms TPOT SLO
        controller.predictor.observe_decode(4, 1000, 0.03)
    router = LoadLedger(1, 1, 1000)
    client = _Client(router)
    router.dispatched("i", 0, 0, 100, 1, tier=Tier(0))
    router.prefilled("i")  # decoding now
    batch = Tier.BATCH
    assert "serving interactive requests" in (controller.hold_reason(client, batch, 100, 0, 16) or "")  # type: ignore[arg-type]
    assert controller.hold_reason(client, batch, 100, 0, 1) is None  # type: ignore[arg-type]  # no TPOT
    router.finished("i")
    assert controller.hold_reason(client, batch, 100, 0, 16) is None  # type: ignore[arg-type]


def test_with_prediction_off_nothing_is_held() -> None:
    cfg = _cfg(**{"admission.predict": False})
    assert not AdmissionController(cfg).holds(Tier.BATCH)


def test_the_hold_lets_calls_go_in_arrival_order_one_at_a_time_when_ready() -> None:
    """Three calls wait while the service is busy; each is let go only when the check passes for
    it at the head of the line (the check sees the ones let go before it), in arrival order."""

    async def scenario() -> tuple[list[str], list[tuple[int, int]], float]:
        hold = DispatchHold(poll_s=0.005)
        busy = [True]
        dispatched: list[str] = []
        queued: list[tuple[int, int]] = []

        def ready() -> bool:
            return not busy[0] and len(dispatched) < 2  # room for two only

        async def call(name: str) -> None:
            await hold.wait(ready, 1, 100, longest_s=0.5)
            dispatched.append(name)

        tasks = [asyncio.create_task(call(n)) for n in ("a", "b", "c")]
        await asyncio.sleep(0.03)
        queued.append(hold.queued())
        busy[0] = False
        await asyncio.sleep(0.05)
        queued.append(hold.queued())
        begun = asyncio.get_running_loop().time()
        await asyncio.gather(*tasks)  # "c" goes when its longest hold has passed
        return dispatched, queued, asyncio.get_running_loop().time() - begun

    dispatched, queued, waited = asyncio.run(scenario())
    assert dispatched == ["a", "b", "c"]
    assert queued == [(3, 300), (1, 100)]
    assert 0.2 < waited < 0.6


def test_a_call_finds_the_line_empty_and_ready_goes_at_once_and_a_cancelled_one_leaves_the_line() -> None:
    async def scenario() -> tuple[float, tuple[int, int], int]:
        hold = DispatchHold(poll_s=0.005)
        waited = await hold.wait(lambda: True, 1, 10, longest_s=5.0)
        task = asyncio.create_task(hold.wait(lambda: False, 2, 20, longest_s=5.0))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return waited, hold.queued(), hold.num_held

    waited, queued, held = asyncio.run(scenario())
    assert waited == 0.0 and queued == (0, 0) and held == 1


def test_poll_s_must_be_positive() -> None:
    with pytest.raises(ValueError, match="poll_s"):
        DispatchHold(poll_s=0)


def test_decode_room_is_kept_for_a_tighter_tier_sent_lately() -> None:
    """No interactive request runs, but one was sent a moment ago: a standard request that would
    make the decode step (with room for two more) slower than interactive's TPOT SLO is refused,
    so the next interactive call finds room; once interactive calls stop coming, it is admitted."""
    from mm_serve.admission import controller as controller_module
    from mm_serve.admission.rejection import Rejection

    cfg = _cfg()
    controller = AdmissionController(cfg)
    for i in range(200):  # 5 ms + 4 ms per request: 2 alone make 13 ms, 4 make 21 (interactive's SLO is 20)
        batch = 1 + i % 8
        controller.predictor.observe_decode(batch, 0, 0.005 + 0.004 * batch)
    router = LoadLedger(1, 1, 1000)
    router.dispatched("s", 0, 0, 100, 1, tier=Tier(1))
    router.prefilled("s")  # a standard request decoding: not idle
    client = _Client(router)
    standard, interactive = Tier.STANDARD, Tier.INTERACTIVE
    assert controller.admit(client, standard, 100, 0, 16) is not None  # type: ignore[arg-type]
    controller.note_call(interactive)
    with pytest.raises(Rejection, match="keeping room for interactive requests"):
        controller.admit(client, standard, 100, 0, 16)  # type: ignore[arg-type]
    assert "keeping room" in (controller.hold_reason(client, Tier.BATCH, 100, 0, 16) or "")  # type: ignore[arg-type]
    controller._last_call[0] -= controller_module.DEMAND_WINDOW_S + 1  # that call is no longer recent
    assert controller.admit(client, standard, 100, 0, 16) is not None  # type: ignore[arg-type]
    # a tighter tier whose TPOT SLO two requests alone would miss gets no room kept (it is refused anyway)
    tight = AdmissionController(_cfg(**{"slo.tiers.interactive": {"ttft_ms": 1000, "tpot_ms": 5}}))
    for i in range(200):
        batch = 1 + i % 8
        tight.predictor.observe_decode(batch, 0, 0.005 + 0.004 * batch)
    tight.note_call(interactive)
    assert tight.admit(client, standard, 100, 0, 16) is not None  # type: ignore[arg-type]


def test_a_check_that_raises_lets_the_call_go_and_a_departed_client_leaves_the_line() -> None:
    """A failing check must not strand the line (the call goes; its admission answers it), and a
    call whose client went away leaves the line with ConnectionAbortedError."""

    async def scenario() -> tuple[float, tuple[int, int], int]:
        hold = DispatchHold(poll_s=0.005)

        def broken() -> bool:
            raise RuntimeError("no view")

        blocker = asyncio.create_task(hold.wait(lambda: False, 1, 1, longest_s=0.05))  # the line is not empty
        await asyncio.sleep(0.01)
        waited = await hold.wait(broken, 1, 10, longest_s=5.0)  # goes once it reaches the head

        async def gone() -> bool:
            return True

        with pytest.raises(ConnectionAbortedError):
            await hold.wait(lambda: False, 3, 30, longest_s=5.0, gone=gone)
        await blocker
        return waited, hold.queued(), hold.num_released_by_time

    waited, queued, by_time = asyncio.run(scenario())
    assert waited < 1.0 and queued == (0, 0) and by_time == 1


def test_each_waiter_keeps_its_own_time_when_the_poller_is_gone() -> None:
    async def scenario() -> float:
        hold = DispatchHold(poll_s=0.005)
        task = asyncio.create_task(hold.wait(lambda: False, 1, 1, longest_s=0.1))
        await asyncio.sleep(0.01)
        assert hold._poller is not None
        hold._poller.cancel()  # whatever stops the poller, the waiter still goes at its time
        return await task

    assert 0.09 < asyncio.run(scenario()) < 1.0


def test_a_batch_request_waits_while_a_tighter_tier_sent_lately_misses_its_slo() -> None:
    """What is measured wins over what is predicted: an interactive request decodes (the prediction has
    nothing against a batch request joining it), but interactive requests sent lately have been finishing
    late, so the batch call waits. With no tighter request running it goes (the factor drifts back to 1
    over minutes once the load is gone), as it does once interactive calls stop coming; a late standard
    tier holds it as well."""
    from mm_serve.admission import controller as controller_module

    controller = AdmissionController(_cfg())
    router = LoadLedger(1, 1, 1000)
    client = _Client(router)
    router.dispatched("i", 0, 0, 100, 1, tier=Tier(0))
    router.prefilled("i")  # decoding now
    controller.note_call(Tier.INTERACTIVE)
    assert controller.hold_reason(client, Tier.BATCH, 100, 0, 16) is None  # type: ignore[arg-type]
    for _ in range(3):  # three interactive requests 40 ms a token against a 20 ms TPOT SLO
        controller.feedback.observe(Tier.INTERACTIVE, 0.1, 0.04)
    factor = controller.limit_factor(Tier.INTERACTIVE, "tpot")
    assert factor == pytest.approx(0.923 ** 3, rel=0.02)
    reason = controller.hold_reason(client, Tier.BATCH, 100, 0, 16)  # type: ignore[arg-type]
    assert reason == f"interactive requests have been missing their TPOT SLO (attainment feedback x{factor:.2f})"
    assert controller.hold_reason(client, Tier.INTERACTIVE, 100, 0, 16) is None  # type: ignore[arg-type]
    controller._last_call[0] -= controller_module.DEMAND_WINDOW_S + 1  # no interactive call lately
    assert controller.hold_reason(client, Tier.BATCH, 100, 0, 16) is None  # type: ignore[arg-type]
    controller.note_call(Tier.STANDARD)
    controller.feedback.observe(Tier.STANDARD, 5.0, 0.01)  # a first token 5 s after arrival, its SLO 4 s
    assert "standard requests have been missing their TTFT SLO" in (
        controller.hold_reason(client, Tier.BATCH, 100, 0, 16) or "")  # type: ignore[arg-type]
    router.finished("i")  # nothing tighter runs: the factors speak of a load that is gone
    assert controller.hold_reason(client, Tier.BATCH, 100, 0, 16) is None  # type: ignore[arg-type]


def test_room_is_kept_for_a_tier_whose_slo_is_met_alone_however_tight_its_feedback() -> None:
    """Two interactive requests alone decode in 13 ms against a 20 ms TPOT SLO: room is kept for them
    (a batch call that would make the step 21 ms waits) even after the feedback tightened interactive's
    limits to x0.5 for lateness: that factor says how loaded the service is, not whether the SLO can
    be met at all (read that way, it let batch work in exactly while interactive calls were late)."""
    controller = AdmissionController(_cfg(**{"admission.attainment_feedback": True}))
    for i in range(200):  # 5 ms + 4 ms per request
        batch = 1 + i % 8
        controller.predictor.observe_decode(batch, 0, 0.005 + 0.004 * batch)
    router = LoadLedger(1, 1, 1000)
    router.dispatched("s", 0, 0, 100, 1, tier=Tier(1))
    router.prefilled("s")
    client = _Client(router)
    controller.note_call(Tier.INTERACTIVE)
    prediction = controller._predict_in(client.load_view(Tier.BATCH, 100, 16), Tier.BATCH, 100, 0)
    assert controller._protect_excess(Tier.BATCH, prediction, 16) is not None
    for _ in range(12):  # interactive requests 40 ms a token: the feedback at its floor
        controller.feedback.observe(Tier.INTERACTIVE, 0.1, 0.04)
    assert controller.limit_factor(Tier.INTERACTIVE, "tpot") == pytest.approx(0.5)
    assert "keeping room for interactive requests" in (
        controller._protect_excess(Tier.BATCH, prediction, 16) or "")
