"""A simulated colocated instance: prefill and decode share the GPUs (vLLM-style).

The baseline DistServe compares against (arXiv:2401.09670, §2.2 and §6): one
continuous-batching engine that, at every iteration boundary, runs a prefill batch
of waiting requests if any fits (prefill has priority; the running decodes stall
meanwhile), and otherwise one decode step for all running requests. A waiting
request is admitted only when the KV of its whole answer fits, so under memory
pressure new requests queue before prefill (their TTFT grows) instead of being
preempted later.

With :class:`MixedSteps` (the colocated engine's ``scheduler.mixed_step_tokens``; Agrawal et al.,
Sarathi-Serve, OSDI 2024, §4), a step decodes one token of every running request and fills the
rest of that many tokens with prefill chunks (the chunks under way first, then waiting requests FCFS,
the last one cut; at least a KV page's worth of tokens when the decodes fill the budget; at most
``max_prefill`` requests prefilling in a step), as :mod:`text_decode.scheduler` does. Such a step costs the chunks' prefill pass plus the decode
rows' share of a decode step: the decode step's pass constant (reading the weights, launching the
layers) is paid once, by the prefill pass. A chunk of ``T`` tokens after ``P`` computed ones is
priced as ``T`` tokens with ``(P + T)^2 - P^2`` squared-length units (its attention reads the
earlier tokens' KV), so a prompt's chunks add up to its whole-prompt attention. Without a prompt
to prefill, steps run as runs of decode steps (``step_runs``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import partial

from mm_serve.planner.events import EventLoop
from mm_serve.planner.latency_model import DecodeTiming, PrefillTiming
from mm_serve.planner.running_set import RunningSet
from mm_serve.planner.sim_request import NEVER, SimRequest
from mm_serve.planner.step_runs import StepRuns


@dataclass(frozen=True)
class MixedSteps:
    """The colocated engine's mixed steps: ``tokens`` per step (decodes plus prefill chunks), at most
    ``max_prefill`` requests prefilling in one (``scheduler.prefill_batch_size``), and at least
    ``page_size`` prefill tokens when the decodes fill the budget (``kv_cache.page_size``).

    Raises:
        ValueError: a count below 1.
    """

    tokens: int
    max_prefill: int = 8
    page_size: int = 16

    def __post_init__(self) -> None:
        if min(self.tokens, self.max_prefill, self.page_size) < 1:
            raise ValueError(f"mixed steps need tokens, max_prefill and page_size >= 1, got {self}")


class _Chunking:
    """A request whose prompt is being prefilled chunk by chunk: ``done`` of its prompt tokens computed."""

    __slots__ = ("req", "done")

    def __init__(self, req: SimRequest) -> None:
        self.req = req
        self.done = 0


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
        mixed: MixedSteps | None = None,
    ) -> None:
        """``token_budget``: the prefill batch's token cap of whole-prompt steps; ``mixed``: run mixed
        steps instead (None: whole-prompt prefill steps apart from decode steps).

        Raises:
            ValueError: ``mixed`` with a pipeline (``pp > 1``) timing, whose stages this model does not fuse.
        """
        if mixed is not None and (prefill.pp > 1 or decode.pp > 1):
            raise ValueError("mixed steps are modelled without pipeline stages (pp 1)")
        self._mixed = mixed
        self._chunking: list[_Chunking] = []
        self._chunk_kv = 0  # final_context of the requests in _chunking (reserved at their admission)
        self._loop = loop
        self._prefill = prefill
        self._decode = decode
        self._budget = token_budget
        self._waiting: deque[SimRequest] = deque()
        self.running = RunningSet(kv_capacity, max_batch)
        self._steps = StepRuns(loop, decode, self.running, self._end_run)
        self._prefilling = False
        # The dispatcher's queue length: requests waiting or running, not the prefill batch
        # under way. Counting that batch too was tried; it gives the colocated pool 1-8 %
        # less goodput (OPT-13B chat on A100: 4.07 against 4.11 req/s/GPU; DistServe's
        # Figure 1 setting: 3.69 against 3.98), and the baseline keeps the stronger rule.
        self.load = 0

    def submit(self, req: SimRequest) -> None:
        """A new request arrives now."""
        waiting = self._waiting
        waiting.append(req)
        self.load += 1
        if self._mixed is not None:
            if self._steps.active:
                self._steps.cut()  # a mixed step takes it at the next step boundary
            elif not self._prefilling:
                self._iterate()
        elif self._steps.active:
            if len(waiting) == 1:  # it may be prefilled at the next step boundary
                self._steps.cut()
        elif not self._prefilling:
            self._iterate()

    def _dropped_never_fitting(self, head: SimRequest) -> bool:
        """Drop ``head``, the first waiting request, when even an empty instance could never hold it
        (its first token never comes); True when dropped."""
        if not self.running.never_fits(head):
            return False
        self._waiting.popleft().first_token_s = NEVER
        self.load -= 1
        return True

    def _take_prefill_batch(self) -> list[SimRequest]:
        waiting, running = self._waiting, self.running
        batch: list[SimRequest] = []
        tokens = kv = 0
        while waiting:
            head = waiting[0]
            if self._dropped_never_fitting(head):
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
        if self._mixed is not None:
            if self._waiting or self._chunking:
                self._mixed_step()
            elif len(self.running):
                self._steps.start()
            return
        batch = self._take_prefill_batch() if self._waiting else []
        if batch:
            self._prefilling = True
            self.load -= len(batch)
            tokens = sq = images = 0
            for r in batch:
                tokens += r.prompt_tokens
                sq += r.prompt_tokens * r.prompt_tokens
                images += r.num_images
            loop = self._loop
            dt = self._prefill.latency(tokens, sq, len(batch), images)
            loop.at(loop.now + dt, partial(self._end_prefill, batch))
        elif len(self.running):
            self._steps.start()

    def _end_prefill(self, batch: list[SimRequest]) -> None:
        self._prefilling = False
        self.load += len(batch)
        for r in batch:
            self._first_token(r)
        self._iterate()

    def _end_run(self, done: list[SimRequest]) -> None:
        self._finished(done)
        self._iterate()

    def _first_token(self, r: SimRequest) -> None:
        """``r``'s prefill ended now: its first token is out and it joins the running batch (or is done)."""
        now = self._loop.now
        r.first_token_s = now
        r.decode_ready_s = now
        if not self.running.add(r):
            self._finished([r])

    def _finished(self, done: list[SimRequest]) -> None:
        """``done``'s last tokens are out now."""
        now = self._loop.now
        for r in done:
            r.finish_s = now
        self.load -= len(done)

    def _take_chunks(self, budget: int) -> list[tuple[_Chunking, int]]:
        """This mixed step's chunks, ``(request, tokens)`` each, within ``budget`` tokens: the prompts
        under way first, then waiting requests that fit (FCFS; one admitted reserves its whole answer's KV),
        at most ``max_prefill`` of them."""
        assert self._mixed is not None
        cap = self._mixed.max_prefill
        chunks: list[tuple[_Chunking, int]] = []
        for entry in self._chunking:
            if budget <= 0 or len(chunks) == cap:
                return chunks
            n = min(budget, entry.req.prompt_tokens - entry.done)
            chunks.append((entry, n))
            budget -= n
        waiting, running = self._waiting, self.running
        while waiting and budget > 0 and len(chunks) < cap:
            head = waiting[0]
            if self._dropped_never_fitting(head):
                continue
            if not running.fits(head, self._chunk_kv, len(self._chunking)):
                break
            entry = _Chunking(waiting.popleft())
            self._chunking.append(entry)
            self._chunk_kv += head.final_context
            n = min(budget, head.prompt_tokens)
            chunks.append((entry, n))
            budget -= n
        return chunks

    def _mixed_step(self) -> None:
        running, mixed = self.running, self._mixed
        assert mixed is not None
        decodes = len(running)
        chunks = self._take_chunks(max(mixed.tokens - decodes, mixed.page_size))
        if not chunks:  # nothing fits until a running request finishes
            if decodes:
                self._steps.start()
            return
        tokens = sq = images = 0
        for entry, n in chunks:
            tokens += n
            sq += (entry.done + n) ** 2 - entry.done ** 2
            if entry.done == 0:
                images += entry.req.num_images
        dt = self._prefill.stage_time(tokens, sq, len(chunks), images)
        if decodes:
            dt += self._decode.step_time(decodes, running.context) - self._decode.stage_const
        self._prefilling = True
        loop = self._loop
        loop.at(loop.now + dt, partial(self._end_mixed, chunks, decodes))

    def _end_mixed(self, chunks: list[tuple[_Chunking, int]], decodes: int) -> None:
        self._prefilling = False
        if decodes:
            self._finished(self.running.finish_steps(1))
        for entry, n in chunks:
            entry.done += n
            r = entry.req
            if entry.done < r.prompt_tokens:
                continue
            self._chunking.remove(entry)
            self._chunk_kv -= r.final_context
            self._first_token(r)
        self._iterate()
