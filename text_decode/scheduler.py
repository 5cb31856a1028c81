"""Continuous-batching scheduler over a paged KV cache (Orca, Yu et al. OSDI 2022; vLLM, Kwon et al. SOSP 2023).

Without mixed steps (``mixed_step_tokens`` 0), each step is either a prefill step (new or
preempted requests, FCFS, whole prompts within a token budget and a batch-size cap) or a
decode step (one token for every running request). Prefill is given priority, as in
vLLM's default policy before chunked prefill.

With mixed steps (Agrawal et al., Sarathi-Serve, OSDI 2024; vLLM's chunked-prefill
scheduler), every step decodes one token of each running request whose prefill is done
and fills the rest of a budget of ``mixed_step_tokens`` tokens with prefill chunks: first
the next chunk of each request whose prefill is under way (in admission order), then new
or preempted requests from the waiting queue (FCFS, within the batch-size cap), the last
one cut to what is left of the budget. When the decodes alone fill the budget, the step still
prefills one page's worth of tokens (``page_size``), so waiting prompts never starve. A burst of long prompts then costs each running
request one budget-sized step per token, not a stall for the whole burst.
When a decode step lacks pages, the most recently admitted running request of
the lowest SLO tier (highest ``Request.priority``) is preempted by recompute:
its pages are freed and it goes back to the waiting queue, ahead of every
waiting request of its tier or a lower one; its prompt plus the tokens generated so far are prefilled
again later (its image embeddings are kept, so nothing is re-encoded).

With a :class:`~mm_serve.runtime.prefix_cache.PrefixCache` (the colocated engine's), a
request admitted for prefill first takes the cached pages of its longest matching prefix
and only the rest is prefilled; a preempted or finished request's computed full pages are
registered before its pages are freed, so its recompute, and later requests that share
its prefix, reuse them while they stay cached.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mm_serve.kernels.page_pool import PagePool
from mm_serve.runtime.engine_config import EngineConfig
from mm_serve.runtime.kv_cache import pages_for
from mm_serve.runtime.prefix_cache import PrefixCache
from mm_serve.runtime.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What the runner does this step: prefill ``prefill`` (each up to its ``prefill_end``) and
    decode ``decode`` (both only with mixed steps)."""

    prefill: list[Request] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class ContinuousBatchingScheduler:
    """Owns the waiting queue and the running set; allocates and frees KV pages.

    Mutates: the request objects' ``status`` and ``block_table``, and the page pool.
    """

    def __init__(
        self, pool: PagePool, page_size: int, max_running: int, prefill_token_budget: int,
        prefill_batch_size: int, prefix: PrefixCache | None = None, mixed_step_tokens: int = 0,
    ) -> None:
        self.pool = pool
        self.prefix = prefix
        self.page_size = page_size
        self.max_running = max_running
        self.prefill_token_budget = prefill_token_budget
        self.prefill_batch_size = prefill_batch_size
        self.mixed_step_tokens = mixed_step_tokens  # tokens per mixed step; 0: prefill and decode steps apart
        self.prefilling: list[Request] = []  # running requests whose prefill is under way (a chunk is left)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_displaced = 0  # running requests preempted for a waiting one of a higher tier

    @classmethod
    def from_config(
        cls, pool: PagePool, cfg: EngineConfig, prefix: PrefixCache | None = None, mixed: bool = False,
    ) -> ContinuousBatchingScheduler:
        """A scheduler over ``pool`` with ``cfg``'s page size, running cap and prefill budget
        (and ``prefix``, a prefix cache over the same pool); with ``mixed``, ``cfg``'s
        ``mixed_step_tokens`` (the colocated engine's)."""
        return cls(pool, cfg.page_size, cfg.max_running, cfg.prefill_token_budget, cfg.prefill_batch_size, prefix,
                   cfg.mixed_step_tokens if mixed else 0)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        """Queue a new request for prefill: after every waiting request of its tier or a higher one
        (FCFS within a tier)."""
        request.status = RequestStatus.WAITING
        for i, waiting in enumerate(self.waiting):
            if waiting.priority > request.priority:
                self.waiting.insert(i, request)
                return
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Adopt a request whose KV is already in its ``block_table`` pages (a claimed hand-off)."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def can_admit(self, num_pages: int) -> bool:
        """Whether a hand-off needing ``num_pages`` pages can join the running set now."""
        return len(self.running) < self.max_running and self.pool.can_allocate(num_pages)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work and set each prefill request's ``prefill_end`` (0: to its last
        token); see the module docstring for the policy."""
        if self.mixed_step_tokens:
            return self._schedule_mixed()
        prefill = self._admit_prefill()
        if prefill:
            return SchedulerOutput(prefill=prefill)
        preempted = self._reserve_decode_pages()
        return SchedulerOutput(decode=list(self.running), preempted=preempted)

    def _schedule_mixed(self) -> SchedulerOutput:
        preempted = self._reserve_decode_pages()
        decodes = sum(1 for r in self.running if r not in self.prefilling)
        budget = max(self.mixed_step_tokens - decodes, self.page_size)
        chunks: list[Request] = []
        for request in self.prefilling:
            if budget <= 0:
                break
            budget -= request.set_prefill_chunk(budget)
            chunks.append(request)
        admitted = self._admit_prefill(budget, len(chunks)) if budget > 0 else []
        decode = [r for r in self.running if r not in self.prefilling and r not in admitted]
        self.prefilling.extend(r for r in admitted if r.prefill_end)
        chunks = [r for r in chunks if r in self.running]  # less any displaced by a higher tier
        return SchedulerOutput(prefill=chunks + admitted, decode=decode, preempted=preempted)

    def chunk_done(self, requests: list[Request]) -> None:
        """Record a mixed step's prefill pass of ``requests``: the KV of each now ends at its
        ``prefill_end``; one whose pass reached its last token decodes from the next step."""
        for request in requests:
            if not request.prefill_done:
                request.end_chunk()
            elif request in self.prefilling:
                self.prefilling.remove(request)

    def _admit_prefill(self, budget: int | None = None, batch_size: int = 0) -> list[Request]:
        """Move waiting requests to the running set with pages for all their tokens, FCFS. With a
        ``budget`` (mixed steps: tokens left in the step; ``batch_size`` requests already in its
        prefill), admission stops when it is spent and the last one admitted runs a chunk;
        without, whole prompts up to the prefill token budget (the first one always)."""
        batch: list[Request] = []
        tokens = 0
        while (self.waiting and len(self.running) < self.max_running
               and batch_size + len(batch) < self.prefill_batch_size):
            request = self.waiting[0]
            n = request.num_tokens
            if budget is not None and tokens >= budget:
                break
            if budget is None and batch and tokens + n > self.prefill_token_budget:
                break
            need = self.prefix.pages_needed(request) if self.prefix else pages_for(n, self.page_size)
            while not self.pool.can_allocate(need):
                if not self.displace(need, request.priority):
                    break
                # a displaced request's pages that this one shares are free now and count as needed
                need = self.prefix.pages_needed(request) if self.prefix else need
            if not self.pool.can_allocate(need):
                break
            if self.prefix is not None:
                self.prefix.allocate(request)
            else:
                request.block_table = self.pool.allocate(need)
                request.num_cached_tokens = 0
            request.status = RequestStatus.RUNNING
            self.waiting.popleft()
            self.running.append(request)
            batch.append(request)
            tokens += n if budget is None else request.set_prefill_chunk(budget - tokens)
        return batch

    def _reserve_decode_pages(self) -> list[Request]:
        """Give every running request room for its next token, preempting the newest if needed."""
        preempted: list[Request] = []
        index = 0
        while index < len(self.running):
            request = self.running[index]
            need = pages_for(request.num_tokens, self.page_size) - len(request.block_table)
            if need <= 0:
                index += 1
                continue
            if self.pool.can_allocate(need):
                request.block_table.extend(self.pool.allocate(need))
                index += 1
                continue
            victim = self._victim()
            if self.running.index(victim) < index:  # an earlier one (a lower tier admitted first): the
                index -= 1  # requests after it move up one place, this one included
            self._preempt(victim)
            preempted.append(victim)
        return preempted

    def displace(self, num_pages: int, priority: int) -> list[Request]:
        """Preempt running requests of a lower tier than ``priority`` (newest first, lowest tier
        first) until ``num_pages`` pages and a running slot are free; returns them.

        Preempts nothing (and returns ``[]``) when even all of them would not make the room.
        """
        lower = [r for r in self.running if r.priority > priority]
        if self.pool.num_free + sum(len(r.block_table) for r in lower) < num_pages:
            return []
        chosen: list[Request] = []
        for victim in sorted(lower, key=lambda r: (-r.priority, -self.running.index(r))):
            if self.pool.can_allocate(num_pages) and len(self.running) < self.max_running:
                break
            chosen.append(victim)
            self._preempt(victim)
        self.num_displaced += len(chosen)
        return chosen

    def _victim(self) -> Request:
        """The running request to preempt: of the lowest tier, the newest admitted."""
        lowest = max(r.priority for r in self.running)
        return next(r for r in reversed(self.running) if r.priority == lowest)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._free(request)
        request.prefill_end = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue(request)

    def _requeue(self, request: Request) -> None:
        """Put a preempted request back: before the first waiting request of its tier or a lower one."""
        for i, waiting in enumerate(self.waiting):
            if waiting.priority >= request.priority:
                self.waiting.insert(i, request)
                return
        self.waiting.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Mark ``request`` finished with ``status``, free its pages, drop it from the queues."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.block_table:
            self._free(request)
        request.status = status

    def _free(self, request: Request) -> None:
        """Return a running request's pages; with a prefix cache, its full pages with computed KV
        (every token but the last sampled one, once it has outputs) are registered first."""
        computed = request.num_tokens - 1 if request.output_token_ids else 0
        if request in self.prefilling:  # a chunked prefill under way: its KV ends where its chunks did
            self.prefilling.remove(request)
            computed = request.num_cached_tokens
        if self.prefix is None:
            self.pool.free(request.block_table)
        else:
            self.prefix.release(request, computed)
        request.block_table = []
