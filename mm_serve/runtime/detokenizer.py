"""Incremental detokenization with stop strings, for streaming.

Guarantees for the text deltas it emits, concatenated:

* they equal the final text (no repeats, no replacement characters from a
  multi-byte character split across tokens: text ending in U+FFFD is held back
  until the character completes);
* no prefix of a stop string is emitted before it is known not to become a stop
  string (the last ``longest stop - 1`` characters are held, vLLM's rule);
* a stop string that spans tokens is found and cut, with everything after it, by an
  Aho-Corasick automaton over the stop strings (:mod:`mm_serve.runtime.stop_strings`) that
  scans only the window a step can complete one in: the cost of a step does not grow with
  the number of stop strings;
* with ``min_tokens``, a stop string counts only where it ends in the text of a token after
  the first ``min_tokens`` (vLLM checks stop strings only once more tokens than that are out).

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

from mm_serve.runtime.stop_strings import StopStrings


class IncrementalDetokenizer:
    """Feed output token ids; get safe-to-send text deltas and stop-string detection."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...] = (), skip_special_tokens: bool = True,
                 min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.min_tokens = min_tokens
        self._stops_from = 0  # a stop string must end at or after this character (the text of min_tokens tokens)
        self._matcher = StopStrings(stops) if stops else None
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
        short = self.min_tokens - len(self.token_ids)  # tokens still to come before stop strings count
        if self._matcher is not None and 0 < short < len(token_ids):  # the boundary falls inside: one side each
            return self.add(token_ids[:short]) + self.add(token_ids[short:])
        self.token_ids.extend(token_ids)
        pending = self._pending()
        full = self._decoded + pending
        if self._matcher is not None and len(self.token_ids) <= self.min_tokens:
            self._stops_from = len(full)
        elif self._matcher is not None:
            found = self._matcher.first(full, max(0, self.sent - self._matcher.longest), self._stops_from)
            if found is not None:
                self.text = full[: found[0]]
                self.stop_string = found[1]
                return self._emit(len(self.text))
        self.text = full
        safe = len(full)
        while safe > self.sent and full[safe - 1] == "\ufffd":
            safe -= 1
        if self._matcher is not None:
            safe = max(self.sent, safe - self._matcher.hold)
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
