"""Prefill batching: by SLO tier, then arrival, with a token budget per batch, grouped by length bucket.

DistServe (§4.1) batches prefill only up to the length where the GPU saturates;
beyond that, batching adds latency without throughput. The budget
(``scheduler.prefill_token_budget``) is that length.

Order: the queue is read by ``(rank, arrival)``, where ``rank`` is the request's tier
(``Request.priority``: 0 interactive, 1 standard, 2 batch), except that a request
waiting longer than its own ``max_wait_s`` (its tier's TTFT SLO) counts as rank 0
(ageing: a batch request cannot starve behind a stream of interactive ones). Within a
rank, arrival order (FCFS). The first request in that order always runs next; later
ones join its batch only if they are in the same length bucket (similar lengths waste
less work on padded backends) and fit the budget.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from mm_serve.runtime.request import Request

BUCKET_EDGES = (32, 128, 512, 2048, 8192)  # tokens; bucket i holds lengths <= BUCKET_EDGES[i]


def length_bucket(num_tokens: int) -> int:
    """Index of the length bucket of a prompt of ``num_tokens`` tokens."""
    for i, edge in enumerate(BUCKET_EDGES):
        if num_tokens <= edge:
            return i
    return len(BUCKET_EDGES)


class PrefillScheduler:
    """The prefill queue of one prefill worker."""

    def __init__(self, token_budget: int, batch_size: int, lookahead: int = 32) -> None:
        self.token_budget = token_budget
        self.batch_size = batch_size
        self.lookahead = lookahead  # queued requests scanned for bucket-mates
        self.queue: deque[Request] = deque()

    @property
    def queued_tokens(self) -> int:
        return sum(r.num_tokens for r in self.queue)

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, request: Request) -> None:
        self.queue.append(request)

    def remove(self, request_id: str) -> Request | None:
        """Drop a queued request (abort); returns it, or None if it is not queued."""
        for request in self.queue:
            if request.request_id == request_id:
                self.queue.remove(request)
                return request
        return None

    def ordered(self, now: float | None = None) -> list[Request]:
        """The queue in service order at ``now`` (``time.monotonic()`` seconds; see the module docstring)."""
        now = time.monotonic() if now is None else now

        def rank(request: Request) -> int:
            aged = request.max_wait_s > 0 and now - request.arrival_time > request.max_wait_s
            return 0 if aged else request.priority

        return sorted(self.queue, key=rank)  # stable: arrival order within a rank

    def next_batch(self, can_fit: Callable[[list[Request]], bool], now: float | None = None) -> list[Request]:
        """Pop the next batch; ``can_fit(batch)`` says whether memory allows a candidate batch.

        Returns an empty list when even the first request in service order does not fit
        (backpressure: nothing overtakes it, so it cannot starve).
        """
        order = self.ordered(now)
        if not order or not can_fit([order[0]]):
            return []
        head = order[0]
        batch = [head]
        tokens = head.num_tokens
        bucket = length_bucket(head.num_tokens)
        for request in order[1 : self.lookahead]:
            if len(batch) >= self.batch_size:
                break
            n = request.num_tokens
            if length_bucket(n) != bucket or tokens + n > self.token_budget:
                continue
            if can_fit([*batch, request]):
                batch.append(request)
                tokens += n
        for request in batch:
            self.queue.remove(request)
        return batch
