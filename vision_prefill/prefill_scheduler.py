"""Prefill batching: by SLO tier, then arrival, with a token budget per batch, grouped by length bucket.

DistServe (§4.1) batches prefill only up to the length where the GPU saturates;
beyond that, batching adds latency without throughput. The budget
(``scheduler.prefill_token_budget``) is that length.

Order: the queue is read by ``(rank, arrival)``, where ``rank`` is the request's tier
(``Request.priority``: 0 interactive, 1 standard, 2 batch), except that a request
waiting longer than its own ``max_wait_s`` (:func:`mm_serve.admission.tiers.ageing_seconds`) counts as rank 0
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
    """The prefill queue of one prefill worker.

    With ``chunk_tokens`` > 0 a request with more tokens left to prefill than that is
    prefilled in chunks of ``chunk_tokens`` (chunked prefill: Agrawal et al., Sarathi-Serve,
    OSDI 2024): the scheduler sets its ``Request.prefill_end`` for the pass, the worker puts it
    back with :meth:`add_front` until its last chunk, and later chunks attend to the KV of the
    earlier ones. A batch whose head is a chunk takes mates from any length bucket (a long
    mate as a chunk of its own) within the token budget, so requests behind a very long one
    wait for one chunk, not for the whole prompt.
    """

    def __init__(self, token_budget: int, batch_size: int, lookahead: int = 32, chunk_tokens: int = 0) -> None:
        self.token_budget = token_budget
        self.batch_size = batch_size
        self.lookahead = lookahead  # queued requests scanned for bucket-mates
        self.chunk_tokens = chunk_tokens  # tokens per prefill pass of one long request; 0 = never split
        self.queue: deque[Request] = deque()

    @staticmethod
    def remaining(request: Request) -> int:
        """Tokens of ``request`` still to prefill (all of them, less the chunks already done)."""
        return request.num_tokens - request.num_cached_tokens

    @property
    def queued_tokens(self) -> int:
        return sum(self.remaining(r) for r in self.queue)

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, request: Request) -> None:
        self.queue.append(request)

    def add_front(self, request: Request) -> None:
        """Put back a request whose prefill is under way (a chunk is left): it runs before every
        other request of its rank."""
        self.queue.appendleft(request)

    def remove(self, request_id: str) -> Request | None:
        """Drop a queued request (abort); returns it, or None if it is not queued."""
        for request in self.queue:
            if request.request_id == request_id:
                self.queue.remove(request)
                return request
        return None

    def set_chunk(self, request: Request) -> bool:
        """Set ``request.prefill_end`` for its next pass from where its KV ends now
        (``num_cached_tokens``: call again after a prefix-cache hit moved it); returns whether
        the pass is a chunk (0: it runs to the last token)."""
        request.set_prefill_chunk(self.chunk_tokens)
        return request.prefill_end != 0

    def ordered(self, now: float | None = None) -> list[Request]:
        """The queue in service order at ``now`` (``time.monotonic()`` seconds; see the module docstring)."""
        now = time.monotonic() if now is None else now

        def rank(request: Request) -> int:
            aged = request.max_wait_s > 0 and now - request.arrival_time > request.max_wait_s
            return 0 if aged else request.priority

        return sorted(self.queue, key=rank)  # stable: arrival order within a rank

    def next_batch(self, can_fit: Callable[[list[Request]], bool], now: float | None = None) -> list[Request]:
        """Pop the next batch; ``can_fit(batch)`` says whether memory allows a candidate batch.
        Sets each chosen request's ``prefill_end`` (a chunk's end, or 0: to the last token).

        Returns an empty list when even the first request in service order does not fit
        (backpressure: nothing overtakes it, so it cannot starve).
        """
        order = self.ordered(now)
        if not order or not can_fit([order[0]]):
            return []
        head = order[0]
        chunked = self.set_chunk(head)
        batch = [head]
        tokens = self.chunk_tokens if chunked else self.remaining(head)
        bucket = length_bucket(tokens)
        for request in order[1 : self.lookahead]:
            if len(batch) >= self.batch_size:
                break
            n = min(self.remaining(request), self.chunk_tokens or self.remaining(request))  # its pass
            if (not chunked and length_bucket(n) != bucket) or tokens + n > self.token_budget:
                continue
            if can_fit([*batch, request]):
                chunked |= self.set_chunk(request)  # a long mate runs a chunk of its own
                batch.append(request)
                tokens += n
        for request in batch:
            self.queue.remove(request)
        return batch
