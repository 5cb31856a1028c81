"""The shortest text that completes a JSON value being written, kept up to date byte by byte, so that a
``json_object`` output can always be closed within its ``max_tokens``.

A free-form JSON object has keys and strings of no bound: a model that does not close them runs out of
tokens and leaves a prefix that no parser takes. :class:`JsonClosing` follows the output's bytes (in the
canonical form xgrammar writes with no free whitespace: ``", "`` and ``": "`` separators) and tells how
many bytes at least are still needed (:meth:`JsonClosing.rest`): the open string's closing quote (an
open key's also ``: 0``), a started number's digit or literal's letters, a value after a separator, then
each open container's closer. The structured-output sampler keeps that length within the tokens left and,
when a sampled token would break it, writes the first byte of the rest instead
(:meth:`~mm_serve.runtime.structured_output.GrammarBook.accept`), so the output is complete JSON when the
budget runs out. This follows the JSON grammar of RFC 8259 only as far as the grammar's mask has already
enforced it: it never decides what is valid, only how far the text is from an end.
"""

from __future__ import annotations

_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
_DIGITS = frozenset(b"0123456789")
_NUMBER = frozenset(b"0123456789+-.eE")


class JsonClosing:
    """Where a JSON text being written stands. Feed it bytes (:meth:`feed`); :meth:`rest` is the shortest
    completion (bytes)."""

    def __init__(self, object_only: bool = False) -> None:
        self.object_only = object_only  # the whole text is an object (json_object): its shortest is {}
        self.stack: list[int] = []  # open containers: ord("{") or ord("[")
        self.state = "value"  # what the next byte continues (see rest())
        self.key = False  # the open string is an object key
        self.pending = b""  # a literal's letters still due, or \u's hex digits (as many zeros)
        self.number_ends = False  # a number whose last byte is a digit (it may end here)

    def clone(self) -> JsonClosing:
        """An independent copy (to try a token on)."""
        other = JsonClosing(self.object_only)
        other.stack, other.state, other.key = list(self.stack), self.state, self.key
        other.pending, other.number_ends = self.pending, self.number_ends
        return other

    def feed(self, data: bytes) -> None:
        """Move past ``data`` (bytes the grammar accepted)."""
        for byte in data:
            self._byte(byte)

    def _byte(self, b: int) -> None:
        state = self.state
        if state == "string":
            if b == 0x5C:  # backslash
                self.state = "escape"
            elif b == 0x22:
                self.state = "colon" if self.key else self._after()
            return
        if state == "escape":
            self.state, self.pending = ("unicode", b"0000") if b == ord("u") else ("string", b"")
            return
        if state in ("unicode", "literal"):
            self.pending = self.pending[1:]
            if not self.pending:
                self.state = "string" if state == "unicode" else self._after()
            return
        if state == "number":
            if b in _NUMBER:
                self.number_ends = b in _DIGITS
                return
            state = self.state = self._after()  # the number ended; this byte follows it
        if state == "colon":
            self.state = "colon_space" if b == ord(":") else state
            return
        if state in ("colon_space", "comma_space") and b == ord(" "):
            self.state = "key" if state == "comma_space" and self.stack[-1:] == [ord("{")] else "value"
            return
        if state == "after":
            if b == ord(","):
                self.state = "comma_space"
            elif b in (ord("}"), ord("]")) and self.stack:
                self.stack.pop()
                self.state = self._after()
            return
        self._value_byte(b, state)

    def _value_byte(self, b: int, state: str) -> None:
        """A byte where a value (or, in an object, a key; after an opener, its closer) may start."""
        if b in (ord("{"), ord("[")):
            self.stack.append(b)
            self.state = "open"
        elif b == 0x22:
            self.state, self.key = "string", state == "key" or (state == "open" and self.stack[-1:] == [ord("{")])
        elif b in (ord("}"), ord("]")) and state == "open":
            self.stack.pop()
            self.state = self._after()
        elif b in _DIGITS or b == ord("-"):
            self.state, self.number_ends = "number", b in _DIGITS
        elif b in _LITERALS:
            self.state, self.pending = "literal", _LITERALS[b]

    def _after(self) -> str:
        return "after" if self.stack else "done"

    def rest(self) -> bytes:
        """The shortest bytes that complete the text fed so far (b"" once it is complete)."""
        key_tail = b'": 0' if self.key else b'"'
        head = {
            "value": b"{}" if self.object_only and not self.stack else b"0", "open": b"", "key": b'"": 0', "string": key_tail, "escape": b"n" + key_tail,
            "unicode": self.pending + key_tail, "literal": self.pending, "colon": b": 0", "colon_space": b" 0",
            "number": b"" if self.number_ends else b"0", "after": b"", "done": b"",
            "comma_space": b' "": 0' if self.stack[-1:] == [ord("{")] else b" 0",
        }[self.state]
        return head + bytes(ord("}") if c == ord("{") else ord("]") for c in reversed(self.stack))
