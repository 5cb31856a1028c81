"""Prompt text → token ids, by the rules of transformers' processors, on every entry path.

* **BOS.** Special tokens are added (so BOS, where the tokenizer adds one) unless the text
  already starts with the BOS token, which a chat template that emits BOS does: the rule
  of ``ProcessorMixin.apply_chat_template(tokenize=True)`` in transformers (and so of
  LLaVA's documented usage, render then call the processor). A prompt never gets two BOS.
* **User text is text.** In a rendered chat, a special token that the *user* typed (the
  literal ``<image>``, ``</s>``, ...) is tokenized as plain text, as transformers'
  ``split_special_tokens`` does, so it is neither an image placeholder nor a control
  token; the template's own special tokens keep their meaning. Only the typed token is
  re-tokenized, so every other id equals the single-call tokenization.

Raw prompts (completions, the offline ``prompt``) keep special tokens: ``<image>`` there
is the image placeholder, as in transformers' processors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def adds_special_tokens(tokenizer: Any, text: str) -> bool:
    """Whether tokenizing ``text`` adds special tokens: not when it already starts with BOS."""
    bos = tokenizer.bos_token
    return not (bos is not None and text.startswith(str(bos)))


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a raw prompt (special tokens in the text keep their meaning)."""
    return list(tokenizer(text, add_special_tokens=adds_special_tokens(tokenizer, text), verbose=False).input_ids)


def encode_chat(tokenizer: Any, rendered: str, user_texts: Sequence[str]) -> list[int]:
    """Token ids of a rendered chat prompt whose user text parts are ``user_texts`` (in order).

    Each user text is located in ``rendered`` in order (templates copy content verbatim;
    one that is not found is not escaped); a special token lying inside one is replaced by
    the ids of its text tokenized with ``split_special_tokens``.
    """
    enc = tokenizer(rendered, add_special_tokens=adds_special_tokens(tokenizer, rendered),
                    return_offsets_mapping=True, verbose=False)
    ids: list[int] = list(enc.input_ids)
    spans = _user_spans(rendered, user_texts)
    special = set(tokenizer.all_special_ids)
    if not spans or not special.intersection(ids):
        return ids
    out: list[int] = []
    for token, (start, end) in zip(ids, enc.offset_mapping, strict=True):
        if token in special and end > start and any(lo <= start and end <= hi for lo, hi in spans):
            piece = rendered[start:end]
            out.extend(tokenizer(piece, add_special_tokens=False, split_special_tokens=True, verbose=False).input_ids)
        else:
            out.append(token)
    return out


def _user_spans(rendered: str, user_texts: Sequence[str]) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of each user text in ``rendered``, searched in order."""
    spans = []
    at = 0
    for text in user_texts:
        if not text:
            continue
        found = rendered.find(text, at)
        if found < 0:
            continue
        spans.append((found, found + len(text)))
        at = found + len(text)
    return spans
