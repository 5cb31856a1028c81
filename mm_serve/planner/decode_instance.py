"""A simulated decode instance: FCFS admission by KV capacity, continuous batching."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from mm_serve.planner.events import EventLoop
from mm_serve.planner.latency_model import DecodeTiming
from mm_serve.planner.running_set import RunningSet
from mm_serve.planner.sim_request import NEVER, SimRequest
from mm_serve.planner.step_runs import StepRuns


class DecodeInstance:
    """Generates tokens for requests whose KV has arrived.

    Requests wait FCFS until the running batch has room (``max_batch`` requests and
    ``kv_capacity`` tokens, see :class:`RunningSet`); admission happens only between
    steps (iteration-level scheduling, Orca, Yu et al. OSDI 2022). One step gives every
    running request one token and takes ``timing.step_time(B, context)`` seconds;
    steps are simulated a run at a time (:class:`~mm_serve.planner.step_runs.StepRuns`). A
    request that could never fit is dropped with ``finish_s = NEVER`` (an SLO miss).
    ``on_finish(req)`` is called when its last token is out.
    """

    def __init__(
        self,
        loop: EventLoop,
        timing: DecodeTiming,
        kv_capacity: int,
        max_batch: int,
        on_finish: Callable[[SimRequest], None] | None = None,
    ) -> None:
        self._loop = loop
        self._timing = timing
        self._on_finish = on_finish
        self._waiting: deque[SimRequest] = deque()
        self.running = RunningSet(kv_capacity, max_batch)
        self._steps = StepRuns(loop, timing, self.running, self._end_run)
        self.load = 0  # requests waiting or running (the dispatcher's queue length)

    def submit(self, req: SimRequest) -> None:
        """Hand ``req`` (first token already out, KV landed) to this instance now."""
        req.decode_ready_s = self._loop.now
        waiting = self._waiting
        waiting.append(req)
        self.load += 1
        if not self._steps.active:
            self._begin_run()
        elif len(waiting) == 1:  # a blocked head would block it too; else it may join
            self._steps.cut()

    def _finish(self, req: SimRequest) -> None:
        req.finish_s = self._loop.now
        self.load -= 1
        if self._on_finish:
            self._on_finish(req)

    def _admit(self) -> None:
        waiting, running = self._waiting, self.running
        while waiting:
            head = waiting[0]
            if running.never_fits(head):
                waiting.popleft().finish_s = NEVER
                self.load -= 1
                continue
            if not running.fits(head):
                return
            waiting.popleft()
            if not running.add(head):
                self._finish(head)

    def _begin_run(self) -> None:
        if self._waiting:
            self._admit()
        if len(self.running):
            self._steps.start()

    def _end_run(self, done: list[SimRequest]) -> None:
        for req in done:
            self._finish(req)
        self._begin_run()
