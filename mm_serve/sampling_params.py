"""Per-request sampling parameters (the vLLM/OpenAI set we support)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOP_K = 2**31 - 1  # any value at or above the vocabulary size keeps every token


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy decoding (argmax). Otherwise logits are divided
    by ``temperature``, then restricted to the ``top_k`` most likely tokens
    (``0`` = all) and to the smallest set whose probability reaches ``top_p``
    (nucleus sampling, Holtzman et al. 2020), then sampled with a generator
    seeded by ``seed``: the same seed gives the same tokens whatever else is in
    the batch.

    Raises:
        ValueError: any field out of range (the message names the field and value).
    """

    max_tokens: int = 16  # new tokens at most
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; the match is cut from the text
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top log-probabilities to return per token
    n: int = 1
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be an integer in [0, {MAX_TOP_K}] (0 = off), got {self.top_k!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= 16:
            raise ValueError(f"n must be an integer in [1, 16], got {self.n!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
