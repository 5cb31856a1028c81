"""Decode steps simulated a run at a time: one event per stretch of steps with an
unchanged batch, instead of one event per step.

Between two changes of the running batch (a request finishing, or one joining) every
step has the same batch size ``B`` and a context that grows by ``B`` tokens, so the
step end times are known in advance: ``t_j = t_{j-1} + step_time(B, C + (j-1) B)``.
A run is scheduled as one event at the end of its last step (the step after which
the first running request finishes, or ``MAX_RUN_STEPS`` steps if that is sooner).
If a request that may join arrives during the run, the run is cut at the first step
boundary at or after that instant, where the step-by-step schedule would have
admitted it. The boundary times are summed in the
same order as one event per step would sum them, so the per-request times are the
same floats; only the ordering of events at exactly equal times may differ.

The planner's searches simulate millions of decode steps; most of them change
nothing but the clock (a chat answer takes hundreds of steps, and a decode instance
sees an arrival or a finish every few of them), so this cuts the event count several
times over.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from functools import partial

from mm_serve.planner.events import EventLoop
from mm_serve.planner.latency_model import DecodeTiming
from mm_serve.planner.running_set import RunningSet
from mm_serve.planner.sim_request import SimRequest

MAX_RUN_STEPS = 32  # a longer run is split: its step times would mostly be thrown away by a cut


class StepRuns:
    """Runs decode steps of ``running`` and calls ``on_end(done)`` at the end of each
    run, ``done`` being the requests whose last token came out (possibly none, when
    the run was cut for an arrival).

    The owner calls :meth:`start` with a non-empty batch when it is idle, and
    :meth:`cut` when a request arrives that could join at the next step boundary.
    """

    def __init__(
        self,
        loop: EventLoop,
        timing: DecodeTiming,
        running: RunningSet,
        on_end: Callable[[list[SimRequest]], None],
    ) -> None:
        self._loop = loop
        self._timing = timing
        self._running = running
        self._on_end = on_end
        self._ends: list[float] = []  # step end times of the run in progress (seconds)
        self._token = 0  # identifies the run whose end event is current
        self.active = False

    def start(self) -> None:
        """Begin steps now, until the first running request finishes, a cut, or
        ``MAX_RUN_STEPS`` steps, whichever comes first.

        Raises:
            ValueError: the running batch is empty.
        """
        running = self._running
        batch = len(running)
        if not batch:
            raise ValueError("no running request to step")
        steps = min(running.steps_to_next_finish(), MAX_RUN_STEPS)
        self._ends = self._timing.step_ends(self._loop.now, batch, running.context, steps)
        self._schedule(steps)

    def cut(self) -> None:
        """End the run in progress at the first step boundary at or after now (no-op
        when idle, or when that boundary is already the run's last)."""
        if not self.active:
            return
        ends = self._ends
        j = bisect_left(ends, self._loop.now)
        if j >= len(ends) - 1:
            return
        del ends[j + 1:]
        self._schedule(j + 1)

    def _schedule(self, steps: int) -> None:
        self._token += 1
        self.active = True
        self._loop.at(self._ends[-1], partial(self._end, self._token, steps))

    def _end(self, token: int, steps: int) -> None:
        if token != self._token:  # superseded by a cut
            return
        self.active = False
        self._on_end(self._running.finish_steps(steps))
