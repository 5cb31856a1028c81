"""One request's attempts on the workers: the first submission and each migration after a fault.

A request whose worker failed is not lost: it is submitted again as a new *attempt*
under a new wire id (``<request id>#<attempt>``), so anything the old attempt still
sends (a token update already queued, a hand-off a decode worker claims late) is
recognised as stale and dropped. The new attempt is the recompute path of preemption
(vLLM's ``RECOMPUTE``) done across workers: its prompt is the original prompt plus every
output token the front end has already received (and so may have streamed), its
``max_tokens`` is reduced by their number, and its ``output_offset`` makes the random
stream continue at that position (:func:`mm_serve.runtime.sampler.position_seed`). So the
client sees one stream with no token repeated or missing; greedy output equals a run
without the fault, and seeded sampling draws the same tokens too (the logits of a
recompute equal the decode-step logits up to float rounding; the ``fault`` test suite
checks greedy and seeded streams token for token on the tiny models).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from mm_serve.engine.request_state import RequestState
from mm_serve.runtime import messages


@dataclass(eq=False)
class Flight:
    """A request in flight: its state for the caller, its first submission, where it runs now."""

    state: RequestState
    first: messages.PrefillRequest  # attempt 0, as first sent
    attempt: int = 0
    base: int = 0  # outputs received before the current attempt (its start_index 0 is this one)
    prefill: int | None = None  # worker running the current attempt's prefill (or the colocated one)
    decode: int | None = None
    claimed: bool = False  # the current attempt's decode worker reported it (its hand-off was taken)
    parked: bool = False  # waiting for a worker of a role that is restarting
    page_hashes: list[bytes] = field(default_factory=list)  # the prompt's full-page hashes (cache-aware routing)

    @property
    def request_id(self) -> str:
        return self.first.request_id

    @property
    def wire_id(self) -> str:
        """The id the workers know the current attempt by."""
        return self.request_id if self.attempt == 0 else f"{self.request_id}#{self.attempt}"

    @property
    def migrations(self) -> int:
        return self.attempt

    def next_attempt(self) -> None:
        """Start a new attempt from what was received so far (the caller resubmits it)."""
        self.state.drop_unordered()
        self.attempt += 1
        self.base = len(self.state.token_ids)
        self.prefill = self.decode = None
        self.claimed = False

    def remaining_tokens(self) -> int:
        """``max_tokens`` left for the current attempt."""
        return self.first.sampling.max_tokens - self.base

    def message(self, decode_index: int, arrival_time: float) -> messages.PrefillRequest:
        """The :class:`~mm_serve.runtime.messages.PrefillRequest` of the current attempt."""
        if self.attempt == 0:
            return msgspec.structs.replace(self.first, decode_index=decode_index)
        received = self.state.token_ids[: self.base]
        sampling = msgspec.structs.replace(self.first.sampling, max_tokens=self.remaining_tokens(),
                                           min_tokens=max(0, self.first.sampling.min_tokens - self.base))
        return msgspec.structs.replace(
            self.first, request_id=self.wire_id, prompt_token_ids=list(self.first.prompt_token_ids) + received,
            sampling=sampling, decode_index=decode_index, arrival_time=arrival_time, output_offset=self.base,
        )

