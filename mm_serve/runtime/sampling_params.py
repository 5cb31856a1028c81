"""Per-request sampling parameters (the vLLM/OpenAI set we support)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mm_serve.runtime.grammar_spec import GRAMMAR_KINDS

MAX_TOP_K = 2**31 - 1  # any value at or above the vocabulary size keeps every token
MAX_TOKENS = 2**31 - 1
MAX_TOKEN_ID = 2**31 - 1
MAX_SEED = 2**63 - 1024  # the HTTP API's bound too: seeds of n > 1 choices (seed + i) stay int64
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on one token's logit_bias
MAX_PENALTY = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty (either sign)
MAX_REPETITION_PENALTY = 10.0


def _check_int(name: str, value: object, low: int, high: int, note: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}]{' ' + note if note else ''}, got {value!r}")


def _check_real(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (low < value if low_open else low <= value) and value <= high  # type: ignore[operator]
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be a number in {bracket}{low}, {high}], got {value!r}")


GREEDY_BELOW = 1e-5
"""Temperatures below this decode greedily (vLLM's ``_SAMPLING_EPS``): logits divided by a temperature
under ~1e-38 overflow float32 to infinity and the softmax to NaN, and well before that the sampled
distribution is the argmax anyway."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature`` under :data:`GREEDY_BELOW` (0 included) is greedy decoding (argmax). Otherwise logits are divided
    by ``temperature``, then restricted to the ``top_k`` most likely tokens
    (``0`` = all) and to the smallest set whose probability reaches ``top_p``
    (nucleus sampling, Holtzman et al. 2020), then sampled with a generator
    seeded by ``seed``: the same seed gives the same tokens whatever else is in
    the batch.

    With ``structured`` the output follows a grammar (JSON schema, any JSON object, a regular
    expression or a list of choices): tokens it does not allow next are masked first
    (:mod:`mm_serve.runtime.structured_output`).

    Before any of that (greedy too) the logits are adjusted as vLLM does, in this order
    (:mod:`mm_serve.runtime.logit_controls`): stop tokens (EOS unless ``ignore_eos``) are
    masked while fewer than ``min_tokens`` tokens are out, ``logit_bias`` is added
    (token id -> bias in [-100, 100], OpenAI's), the repetition penalty divides positive
    (multiplies negative) logits of every token in the prompt or the output (Keskar et al.
    2019, "CTRL", eq. in §4.1), and OpenAI's penalties subtract ``frequency_penalty`` times
    a token's count in the output plus ``presence_penalty`` once it occurs there.

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
    min_tokens: int = 0  # stop tokens and stop strings take effect only after this many output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, ids distinct
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    structured: tuple[str, str] | None = None  # (kind, text): a grammar the output follows (runtime.structured_output)
    # log-probabilities of each prompt token but the first (the token plus this many best; vLLM's
    # prompt_logprobs): computed by the prefill pass, which then reads no KV from the prefix cache
    prompt_logprobs: int | None = None
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1, MAX_TOKENS)
        _check_real("temperature", self.temperature, 0.0, 100.0)
        _check_real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if self.top_k == -1:  # vLLM's older spelling of "off"
            object.__setattr__(self, "top_k", 0)
        _check_int("top_k", self.top_k, 0, MAX_TOP_K, "(0 or -1 = off)")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, 20)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, 20)
        _check_int("n", self.n, 1, 16)
        if self.seed is not None and self.seed + self.n - 1 > MAX_SEED:
            raise ValueError(f"seed must be at most {MAX_SEED - self.n + 1} with n = {self.n} (choice i draws "
                             f"with seed + i, at most {MAX_SEED}), got {self.seed}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, list | tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, list | tuple):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r:.60}")
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token, 0, MAX_TOKEN_ID)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens, "(at most max_tokens)")
        _check_real("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_real("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_real("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, low_open=True)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            pairs = tuple((token, value) for token, value in bias)
        except (TypeError, ValueError):  # not iterable, or items that are not pairs
            raise ValueError(f"logit_bias must map token ids to biases (a dict or (id, bias) pairs), got "
                             f"{self.logit_bias!r:.60}") from None
        for token, value in pairs:
            _check_int("logit_bias token id", token, 0, MAX_TOKEN_ID)
            _check_real("logit_bias", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if len({token for token, _ in pairs}) != len(pairs):
            raise ValueError("logit_bias names a token id twice")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(v)) for t, v in pairs))
        if self.structured is not None:
            kind, text = self.structured
            if kind not in GRAMMAR_KINDS or not isinstance(text, str):
                raise ValueError(f"structured must be (kind, text) with kind one of {', '.join(GRAMMAR_KINDS)}, "
                                 f"got {self.structured!r:.200}")
            object.__setattr__(self, "structured", (kind, text))

    @property
    def adjusts_logits(self) -> bool:
        """Whether any of ``min_tokens``, ``logit_bias`` or the penalties changes the logits."""
        return bool(self.min_tokens or self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        """Argmax decoding: ``temperature`` below :data:`GREEDY_BELOW`."""
        return self.temperature < GREEDY_BELOW
