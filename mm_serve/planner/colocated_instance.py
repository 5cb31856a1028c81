"""A simulated colocated instance: prefill and decode share the GPUs (vLLM-style).

The baseline DistServe compares against (arXiv:2401.09670, §2.2 and §6): one
continuous-batching engine that, at every iteration boundary, runs a prefill batch
of waiting requests if any fits (prefill has priority; the running decodes stall
meanwhile), and otherwise one decode step for all running requests. A waiting
request is admitted only when the KV of its whole answer fits, so under memory
pressure new requests queue before prefill (their TTFT grows) instead of being
preempted later.
"""

from __future__ import annotations

from collections import deque
from functools import partial

from mm_serve.planner.events import EventLoop
from mm_serve.planner.latency_model import DecodeTiming, PrefillTiming
from mm_serve.planner.running_set import RunningSet
from mm_serve.planner.sim_request import NEVER, SimRequest


class ColocatedInstance:
    """Both phases on one instance; times from the two timings of the same config."""

    def __init__(
        self,
        loop: EventLoop,
        prefill: PrefillTiming,
        decode: DecodeTiming,
        kv_capacity: int,
        token_budget: int,
        max_batch: int,
    ) -> None:
        self._loop = loop
        self._prefill = prefill
        self._decode = decode
        self._budget = token_budget
        self._waiting: deque[SimRequest] = deque()
        self.running = RunningSet(kv_capacity, max_batch)
        self._busy = False

    @property
    def load(self) -> int:
        return len(self._waiting) + len(self.running)

    def submit(self, req: SimRequest) -> None:
        """A new request arrives now."""
        self._waiting.append(req)
        if not self._busy:
            self._iterate()

    def _take_prefill_batch(self) -> list[SimRequest]:
        waiting, running = self._waiting, self.running
        batch: list[SimRequest] = []
        tokens = kv = 0
        while waiting:
            head = waiting[0]
            if running.never_fits(head):
                waiting.popleft().first_token_s = NEVER
                continue
            if batch and tokens + head.prompt_tokens > self._budget:
                break
            if not running.fits(head, kv, len(batch)):
                break
            waiting.popleft()
            batch.append(head)
            tokens += head.prompt_tokens
            kv += head.final_context
        return batch

    def _iterate(self) -> None:
        loop = self._loop
        batch = self._take_prefill_batch()
        if batch:
            self._busy = True
            tokens = sum(r.prompt_tokens for r in batch)
            sq = sum(r.prompt_tokens * r.prompt_tokens for r in batch)
            images = sum(r.num_images for r in batch)
            dt = self._prefill.latency(tokens, sq, len(batch), images)
            loop.at(loop.now + dt, partial(self._end_prefill, batch))
        elif len(self.running):
            self._busy = True
            dt = self._decode.step_time(len(self.running), self.running.context)
            loop.at(loop.now + dt, self._end_step)
        else:
            self._busy = False

    def _end_prefill(self, batch: list[SimRequest]) -> None:
        now = self._loop.now
        for r in batch:
            r.first_token_s = now
            r.decode_ready_s = now
            if not self.running.add(r):
                r.finish_s = now
        self._iterate()

    def _end_step(self) -> None:
        now = self._loop.now
        for r in self.running.finish_step():
            r.finish_s = now
        self._iterate()
