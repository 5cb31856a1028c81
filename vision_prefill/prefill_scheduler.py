"""Prefill batching: FCFS with a token budget per batch, grouped by prompt-length bucket.

DistServe (§4.1) batches prefill only up to the length where the GPU saturates;
beyond that, batching adds latency without throughput. The budget
(``scheduler.prefill_token_budget``) is that length. The head of the queue always
runs next (FCFS, no starvation); later requests join its batch only if they are
in the same length bucket (similar lengths waste less work on padded backends)
and fit the budget.
"""

from __future__ import annotations

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

    def next_batch(self, can_fit: Callable[[list[Request]], bool]) -> list[Request]:
        """Pop the next batch; ``can_fit(batch)`` says whether memory allows a candidate batch.

        Returns an empty list when even the head alone does not fit (backpressure).
        """
        if not self.queue or not can_fit([self.queue[0]]):
            return []
        head = self.queue[0]
        batch = [head]
        tokens = head.num_tokens
        bucket = length_bucket(head.num_tokens)
        for request in list(self.queue)[1 : self.lookahead]:
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
