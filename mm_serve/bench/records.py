"""One benchmark request's client-side timeline: send, content chunks, end, token counts.

All times are seconds on the client's monotonic clock, relative to the start of the
run. The client fills a :class:`RequestRecord` while the stream arrives; the derived
latencies (TTFT, TPOT, ITL, e2e) are properties, so there is one definition of each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mm_serve.ground.slo import SLO


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request. Times in seconds from the run start."""

    index: int  # position in the run's request plan
    max_tokens: int  # output tokens asked for (the answer has at most this many)
    sent_s: float | None = None  # request sent; None = never sent
    chunk_s: list[float] = field(default_factory=list)  # arrival of each non-empty content chunk (or the finish)
    end_s: float | None = None  # stream finished (or failed)
    output_tokens: int = 0  # from the server's usage, else the number of content chunks
    prompt_tokens: int | None = None  # from the server's usage, when reported
    error: str | None = None  # HTTP status / error event / "cancelled" / "not sent"
    tier: str | None = None  # the SLO tier it asked for (--tier-mix)
    turn: int | None = None  # 0-based turn of its conversation; None outside a conversation
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when reported
    content: list[str] = field(default_factory=list)  # the streamed content pieces, in order

    @property
    def ok(self) -> bool:
        """Finished without error."""
        return self.error is None and self.end_s is not None

    @property
    def ttft_s(self) -> float | None:
        """Time to first content token, seconds; None before it arrives."""
        if self.sent_s is None or not self.chunk_s:
            return None
        return self.chunk_s[0] - self.sent_s

    @property
    def answer(self) -> str:
        """The streamed content joined: what a multi-turn client sends back as the assistant message."""
        return "".join(self.content)

    @property
    def e2e_s(self) -> float | None:
        """Send to end of stream, seconds; None while running."""
        if self.sent_s is None or self.end_s is None:
            return None
        return self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float:
        """``(e2e - TTFT) / (output_tokens - 1)`` seconds; 0 for a one-token or unfinished answer."""
        if self.end_s is None or not self.chunk_s or self.output_tokens < 2:
            return 0.0
        return (self.end_s - self.chunk_s[0]) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        """Gaps between consecutive content chunks, seconds."""
        chunks = self.chunk_s
        return [b - a for a, b in zip(chunks, chunks[1:], strict=False)]

    def row(self) -> dict[str, object]:
        """The record as a flat JSON-ready dict (derived latencies in seconds, no chunk list)."""
        return {"index": self.index, "sent_s": self.sent_s, "ttft_s": self.ttft_s, "tpot_s": self.tpot_s,
                "e2e_s": self.e2e_s, "output_tokens": self.output_tokens, "max_tokens": self.max_tokens,
                "prompt_tokens": self.prompt_tokens, "num_chunks": len(self.chunk_s), "error": self.error,
                "tier": self.tier, "turn": self.turn, "cached_tokens": self.cached_tokens}

    def certainly_misses(self, now_s: float, slo: SLO) -> bool:
        """True when, at ``now_s``, this request can no longer meet both SLOs.

        A finished request misses by its measured values. A running one misses once
        its TTFT exceeds the SLO, or once the decode time so far divided by the most
        tokens it can still produce exceeds the TPOT SLO (the final TPOT can only be
        larger, since ``output_tokens <= max_tokens``).
        """
        if self.end_s is not None:
            ttft = self.ttft_s
            return self.error is not None or ttft is None or ttft > slo.ttft_s or self.tpot_s > slo.tpot_s
        if self.sent_s is None:
            return False
        if not self.chunk_s:
            return now_s - self.sent_s > slo.ttft_s
        if self.chunk_s[0] - self.sent_s > slo.ttft_s:
            return True
        return self.max_tokens > 1 and (now_s - self.chunk_s[0]) / (self.max_tokens - 1) > slo.tpot_s
