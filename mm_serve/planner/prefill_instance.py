"""A simulated prefill instance: FCFS queue, token-budget batching, pipelined stages."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial

from mm_serve.planner.events import EventLoop
from mm_serve.planner.latency_model import PrefillTiming
from mm_serve.planner.sim_request import SimRequest


class PrefillInstance:
    """Serves prefills first-come first-served.

    A batch takes queued requests from the head while the batch stays within
    ``token_budget`` prompt tokens and ``max_batch`` requests (the head request always
    goes, however long). With pipeline degree ``p`` a new batch may start every
    ``stage_time`` seconds while earlier ones are still in later stages (DistServe
    §3.1). ``on_done(req)`` is called at the first-token time. ``slowdown()``, when given, is how
    many times longer a batch starting now takes than alone (an instance sharing its core with a
    decode worker: :func:`mm_serve.planner.shared_core.prefill_slowdown`).
    """

    def __init__(
        self,
        loop: EventLoop,
        timing: PrefillTiming,
        token_budget: int,
        max_batch: int,
        on_done: Callable[[SimRequest], None],
        slowdown: Callable[[], float] | None = None,
    ) -> None:
        self._loop = loop
        self._slowdown = slowdown
        self._timing = timing
        self._budget = token_budget
        self._max_batch = max_batch
        self._on_done = on_done
        self._queue: deque[SimRequest] = deque()
        self._stage_busy = False
        self.in_flight = 0

    @property
    def load(self) -> int:
        """Requests queued or being prefilled (the dispatcher's queue length)."""
        return len(self._queue) + self.in_flight

    def submit(self, req: SimRequest) -> None:
        """Enqueue ``req`` now."""
        self._queue.append(req)
        if not self._stage_busy:
            self._start()

    def _take_batch(self) -> list[SimRequest]:
        queue = self._queue
        batch = [queue.popleft()]
        tokens = batch[0].prompt_tokens
        while (queue and len(batch) < self._max_batch
               and tokens + queue[0].prompt_tokens <= self._budget):
            tokens += queue[0].prompt_tokens
            batch.append(queue.popleft())
        return batch

    def _start(self) -> None:
        self._stage_busy = False
        if not self._queue:
            return
        batch = self._take_batch()
        tokens = sq = images = 0
        for r in batch:
            tokens += r.prompt_tokens
            sq += r.prompt_tokens * r.prompt_tokens
            images += r.num_images
        now = self._loop.now
        timing = self._timing
        scale = self._slowdown() if self._slowdown is not None else 1.0
        latency = scale * timing.latency(tokens, sq, len(batch), images)
        self.in_flight += len(batch)
        self._loop.at(now + latency, partial(self._finish, batch))
        self._stage_busy = True
        self._loop.at(now + scale * timing.stage_time(tokens, sq, len(batch), images), self._start)

    def _finish(self, batch: list[SimRequest]) -> None:
        now = self._loop.now
        self.in_flight -= len(batch)
        for r in batch:
            r.first_token_s = now
            self._on_done(r)
