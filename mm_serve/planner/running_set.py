"""The running batch of a continuous-batching (decode or colocated) instance.

Invariants, checked by :meth:`RunningSet.check`:

* ``reserved_kv`` is the sum of ``final_context`` over running requests and never
  exceeds ``kv_capacity``: a request reserves the KV of its whole answer when it is
  admitted, so nothing is ever preempted (vLLM allocates page by page and preempts
  instead; reserving up front is the conservative, preemption-free variant);
* ``context`` is the KV tokens the next step reads: prompt + tokens generated so far,
  summed over running requests;
* a request admitted at step ``s`` with ``k`` tokens still to generate finishes at
  the end of step ``s + k``; the heap is ordered by that step, so the batch stays the
  same for :meth:`RunningSet.steps_to_next_finish` steps (see ``step_runs``).
"""

from __future__ import annotations

import heapq

from mm_serve.planner.sim_request import SimRequest


class RunningSet:
    """Running requests, their KV reservations and finish steps."""

    def __init__(self, kv_capacity: int, max_batch: int) -> None:
        self.kv_capacity = kv_capacity  # tokens
        self.max_batch = max_batch  # requests
        self.reserved_kv = 0
        self.context = 0
        self.steps = 0
        self._heap: list[tuple[int, int, SimRequest]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def never_fits(self, req: SimRequest) -> bool:
        """The request needs more KV than the whole instance has."""
        return req.final_context > self.kv_capacity

    def fits(self, req: SimRequest, extra_kv: int = 0, extra_reqs: int = 0) -> bool:
        """Whether ``req`` can join now (with ``extra_*`` already promised to others)."""
        return (len(self._heap) + extra_reqs < self.max_batch
                and self.reserved_kv + extra_kv + req.final_context <= self.kv_capacity)

    def add(self, req: SimRequest) -> bool:
        """Admit ``req`` (its first token is out). Returns False if it is already done
        (a one-token answer), in which case nothing is reserved."""
        remaining = req.output_tokens - 1
        if remaining <= 0:
            return False
        self.reserved_kv += req.final_context
        self.context += req.prompt_tokens + 1
        heapq.heappush(self._heap, (self.steps + remaining, req.index, req))
        return True

    def steps_to_next_finish(self) -> int:
        """Steps until the first running request produces its last token (>= 1).

        Raises:
            IndexError: nothing is running.
        """
        return self._heap[0][0] - self.steps

    def finish_step(self) -> list[SimRequest]:
        """Account one decode step (every running request gained a token) and return
        the requests that just produced their last token."""
        return self.finish_steps(1)

    def finish_steps(self, steps: int) -> list[SimRequest]:
        """Account ``steps`` decode steps with this batch (no more than
        :meth:`steps_to_next_finish`) and return the requests that just produced
        their last token.

        Raises:
            ValueError: ``steps`` is below 1 or passes a request's last token.
        """
        heap = self._heap
        if steps < 1 or (heap and heap[0][0] < self.steps + steps):
            raise ValueError(f"cannot account {steps} steps with this batch")
        self.steps += steps
        self.context += steps * len(heap)
        done = []
        while heap and heap[0][0] <= self.steps:
            req = heapq.heappop(heap)[2]
            self.reserved_kv -= req.final_context
            self.context -= req.final_context
            done.append(req)
        return done

    def check(self) -> None:
        """Raise AssertionError if an invariant of the module docstring is broken."""
        reqs = [r for _, _, r in self._heap]
        if self.reserved_kv != sum(r.final_context for r in reqs):
            raise AssertionError("reserved_kv out of sync")
        if self.reserved_kv > self.kv_capacity or len(reqs) > self.max_batch:
            raise AssertionError("capacity exceeded")
        left = {r.index: s - self.steps for s, _, r in self._heap}
        expect = sum(r.final_context - left[r.index] for r in reqs)
        if self.context != expect:
            raise AssertionError(f"context {self.context} != {expect}")
