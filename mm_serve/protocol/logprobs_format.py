"""Log-probabilities in OpenAI's chat and completions formats; only finite numbers are emitted."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mm_serve.protocol.schemas import ChoiceLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

FLOOR = -9999.0  # stands in for -inf, which JSON cannot carry


def finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


def _text(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id]))


def _top(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:n]


def chat_logprobs(tokenizer: Any, token_ids: list[int], entries: list[dict[int, float]], top_n: int) -> ChoiceLogprobs:
    """``{"content": [{token, logprob, bytes, top_logprobs}, ...]}`` for ``token_ids``."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        text = _text(tokenizer, token_id)
        top = [TopLogprob(token=_text(tokenizer, t), logprob=finite(lp), bytes=list(_text(tokenizer, t).encode()))
               for t, lp in _top(entry, top_n)]
        content.append(TokenLogprob(token=text, logprob=finite(entry.get(token_id, FLOOR)),
                                    bytes=list(text.encode()), top_logprobs=top))
    return ChoiceLogprobs(content=content)


def completion_logprobs(tokenizer: Any, token_ids: list[int], entries: Sequence[dict[int, float] | None],
                        top_n: int, start_offset: int = 0, before: CompletionLogprobs | None = None) -> CompletionLogprobs:
    """The legacy completions ``logprobs`` object for ``token_ids``, whose first token's text starts at
    character ``start_offset`` of the choice's text (a stream's later chunks; after an echoed prompt),
    appended to ``before`` (an echoed prompt's). A None entry (an echoed prompt's first token, which
    nothing predicts) has a null log-probability and null alternatives, as OpenAI writes it."""
    out = before if before is not None else CompletionLogprobs()
    offset = start_offset
    for token_id, entry in zip(token_ids, entries, strict=False):
        text = _text(tokenizer, token_id)
        out.tokens.append(text)
        out.token_logprobs.append(None if entry is None else finite(entry.get(token_id, FLOOR)))
        out.top_logprobs.append(None if entry is None else {_text(tokenizer, t): finite(lp) for t, lp in _top(entry, top_n)})
        out.text_offset.append(offset)
        offset += len(text)
    return out
