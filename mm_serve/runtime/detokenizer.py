"""Incremental detokenization with stop strings, for streaming.

Guarantees for the text deltas it emits, concatenated:

* they equal the final text (no repeats, no replacement characters from a
  multi-byte character split across tokens: text ending in U+FFFD is held back
  until the character completes);
* no prefix of a stop string is emitted before it is known not to become a stop
  string (the longest tail of the text that is a prefix of a stop string is held);
* a stop string that spans tokens is found and cut, with everything after it.

Each step decodes only a short window of ids, not the whole output: the ids
from ``prefix_offset`` (the start of the previous step's new tokens) to the end,
and the same window without the new ids; the new text is the difference. Both
decodes start at the same token, so a tokenizer that treats the first token of a
decode specially (SentencePiece's leading space) affects them alike, and bytes of
a character split across tokens stay in the window until it completes. The
window is a few tokens long, so a step costs O(1) in the output length (the
whole output was re-decoded each step before: O(n) per token, O(n²) per
request). The same incremental scheme as vLLM's and text-generation-inference's
detokenizers.
"""

from __future__ import annotations

from typing import Any


def held_tail(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class IncrementalDetokenizer:
    """Feed output token ids; get safe-to-send text deltas and stop-string detection."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # decoded text, cut at a stop string once found
        self._decoded = ""  # text of token_ids[:_read_offset]
        self._prefix_offset = 0  # first id of the decode window
        self._read_offset = 0  # ids [_prefix_offset, _read_offset) are already in _decoded
        self.sent = 0  # characters of ``text`` already emitted
        self.stop_string: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; returns the new text that is safe to send now."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        pending = self._pending()
        full = self._decoded + pending
        if self.stops:
            at, which = self._find_stop(full)
            if which is not None:
                self.text = full[:at]
                self.stop_string = which
                return self._emit(len(self.text))
        self.text = full
        safe = len(full)
        while safe > self.sent and full[safe - 1] == "\ufffd":
            safe -= 1
        if self.stops:
            safe -= held_tail(full[:safe], self.stops)
        return self._emit(safe)

    def finish(self) -> str:
        """The request ended: flush whatever is still held (the final text is complete)."""
        return self._emit(len(self.text))

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _pending(self) -> str:
        """Text of the ids after ``_read_offset``; moves the window forward once it ends on a
        whole character (a trailing U+FFFD means the last character is still incomplete)."""
        before = self._decode(self._prefix_offset, self._read_offset)
        after = self._decode(self._prefix_offset)
        new = after[len(before):]
        if new and not new.endswith("\ufffd"):
            self._decoded += new
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
            return ""
        return new

    def _emit(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta = self.text[self.sent : upto]
        self.sent = upto
        return delta

    def _find_stop(self, text: str) -> tuple[int, str | None]:
        search_from = max(0, self.sent - max(len(s) for s in self.stops))
        best, which = len(text), None
        for stop in self.stops:
            at = text.find(stop, search_from)
            if at != -1 and at < best:
                best, which = at, stop
        return best, which
