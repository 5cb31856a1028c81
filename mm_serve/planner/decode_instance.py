"""A simulated decode instance: FCFS admission by KV capacity, continuous batching."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from mm_serve.planner.events import EventLoop
from mm_serve.planner.latency_model import DecodeTiming
from mm_serve.planner.running_set import RunningSet
from mm_serve.planner.sim_request import NEVER, SimRequest


class DecodeInstance:
    """Generates tokens for requests whose KV has arrived.

    Requests wait FCFS until the running batch has room (``max_batch`` requests and
    ``kv_capacity`` tokens, see :class:`RunningSet`); admission happens only between
    steps (iteration-level scheduling, Orca, Yu et al. OSDI 2022). One step gives every
    running request one token and takes ``timing.step_time(B, context)`` seconds. A
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
        self._busy = False

    @property
    def load(self) -> int:
        """Requests waiting or running (the dispatcher's queue length)."""
        return len(self._waiting) + len(self.running)

    def submit(self, req: SimRequest) -> None:
        """Hand ``req`` (first token already out, KV landed) to this instance now."""
        req.decode_ready_s = self._loop.now
        self._waiting.append(req)
        if not self._busy:
            self._begin_step()

    def _finish(self, req: SimRequest) -> None:
        req.finish_s = self._loop.now
        if self._on_finish:
            self._on_finish(req)

    def _admit(self) -> None:
        waiting, running = self._waiting, self.running
        while waiting:
            head = waiting[0]
            if running.never_fits(head):
                waiting.popleft().finish_s = NEVER
                continue
            if not running.fits(head):
                return
            waiting.popleft()
            if not running.add(head):
                self._finish(head)

    def _begin_step(self) -> None:
        self._admit()
        running = self.running
        if not len(running):
            self._busy = False
            return
        self._busy = True
        dt = self._timing.step_time(len(running), running.context)
        self._loop.at(self._loop.now + dt, self._end_step)

    def _end_step(self) -> None:
        for req in self.running.finish_step():
            self._finish(req)
        self._begin_step()
