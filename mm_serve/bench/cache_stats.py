"""What a run says about KV sharing: TTFT per conversation turn, and the prompt-cache hit rate.

* **TTFT per turn**: the TTFT distribution (seconds) of the finished requests of each
  turn, keyed ``"1"``, ``"2"``, ... (1-based, as people count turns) and ``"2+"`` (every
  follow-up turn pooled). Turn 1 is cold (a prefix cache can at most hold a chat
  template); the follow-ups resend the whole history, which a prefix cache holds.
* **Hit rate**: ``sum(cached_tokens) / sum(prompt_tokens)`` over the finished requests
  whose usage reports both (OpenAI's ``usage.prompt_tokens_details.cached_tokens``);
  NaN when no response reports it, so any OpenAI server stays measurable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mm_serve.bench.records import RequestRecord

FOLLOW_UPS = "2+"  # the key of the pooled follow-up turns


def ttfts_by_turn(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """TTFTs (seconds) of the finished requests per 1-based turn, plus ``"2+"`` pooled;
    empty when no record belongs to a conversation."""
    done = [r for r in records if r.ok and r.turn is not None and r.ttft_s is not None]
    if not done:
        return {}
    by_turn: dict[str, list[float]] = {}
    for r in sorted(done, key=lambda r: r.turn or 0):
        by_turn.setdefault(str((r.turn or 0) + 1), []).append(r.ttft_s or 0.0)
    follow_ups = [r.ttft_s or 0.0 for r in done if (r.turn or 0) > 0]
    if follow_ups:
        by_turn[FOLLOW_UPS] = follow_ups
    return by_turn


@dataclass(frozen=True)
class CacheTokens:
    """Prompt and cached-prompt tokens summed over the finished requests that report both."""

    prompt_tokens: int
    cached_tokens: int
    requests: int  # finished requests whose usage had cached_tokens

    @property
    def hit_rate(self) -> float:
        """Cached over prompt tokens, 0..1; NaN when nothing was reported."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens > 0 else math.nan

    @classmethod
    def of(cls, records: Sequence[RequestRecord]) -> CacheTokens:
        reported = [r for r in records if r.ok and r.cached_tokens is not None and r.prompt_tokens is not None]
        return cls(sum(r.prompt_tokens or 0 for r in reported), sum(r.cached_tokens or 0 for r in reported),
                   len(reported))
