"""A simulated request and its lifetime timestamps (DistServe's lifetime events)."""

from __future__ import annotations

import math
from dataclasses import dataclass

NEVER = math.inf  # timestamp of an event that has not happened (or never will)


@dataclass(slots=True)
class SimRequest:
    """One request moving through the simulated cluster. Times in seconds."""

    index: int
    arrival_s: float
    prompt_tokens: int  # LLM prompt tokens, image tokens included
    output_tokens: int  # tokens to generate, first token (from prefill) included
    num_images: int = 0
    first_token_s: float = NEVER  # prefill done: first token out
    decode_ready_s: float = NEVER  # KV landed in the decode instance's queue
    finish_s: float = NEVER  # last token out

    @property
    def final_context(self) -> int:
        """KV tokens held at the end of decoding (prompt + generated)."""
        return self.prompt_tokens + self.output_tokens

    @property
    def ttft(self) -> float:
        """Time to first token, seconds (arrival to first token)."""
        return self.first_token_s - self.arrival_s

    @property
    def tpot(self) -> float:
        """Time per output token after the first, seconds (DistServe §2:
        ``(finish - first token) / (output - 1)``; 0 for a one-token answer)."""
        if self.finish_s == NEVER:
            return NEVER
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)
