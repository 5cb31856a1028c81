"""Where the tool calls are in an output that is still being written: each call object's name and the span of
its arguments, read as they grow, so a stream can send argument deltas (OpenAI's streaming form) that add up
exactly to the arguments of the finished answer.

A call is read in the form every supported writer uses: ``{"name": "<name>", "<key>": <arguments>}`` with
``key`` ``parameters`` (a required tool choice's grammar, Llama 3's JSON form) or ``arguments`` (Hermes /
Qwen ``<tool_call>`` blocks), any JSON whitespace between the tokens. The name counts once its closing quote
and the arguments key are out; the arguments end where a JSON value starting there ends
(:meth:`json.JSONDecoder.raw_decode`). Until then everything after their start belongs to them: an
arguments value that has not ended has no character after it yet.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mm_serve.ground.json_text import JSONTextError, decode_json_at, load_json

_NAME = r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"'  # a call object's start through its name's closing quote
_HEADS = {key: re.compile(_NAME + r'\s*,\s*"' + key + r'"\s*:\s*') for key in ("parameters", "arguments")}
_NAME_ONLY = re.compile(_NAME)


@dataclass(frozen=True)
class CallSpan:
    """One call found in an output.

    Attributes:
        name: the function's name (JSON string escapes read).
        start: the index of the arguments' first character in the output.
        end: the index just past their last one; None while they are still being written.
    """

    name: str
    start: int
    end: int | None

    def arguments(self, text: str) -> str:
        """The arguments' text so far, in ``text`` (the output these spans were read from, or a longer one)."""
        return text[self.start: self.end if self.end is not None else len(text)]


def call_spans(text: str, key: str, at: int = 0, limit: int | None = None) -> list[CallSpan]:
    """The calls in ``text[at:]`` whose head uses arguments ``key`` (``parameters`` or ``arguments``), each
    looked for after the previous one's arguments end, at most ``limit``; the last may be unfinished (then no
    call is looked for after it).

    Raises:
        KeyError: an unknown ``key``.
    """
    head = _HEADS[key]
    spans: list[CallSpan] = []
    while limit is None or len(spans) < limit:
        match = head.search(text, at)
        if match is None:
            break
        name = _name(match.group(1))
        if name is None:  # a bad escape: not a call head
            at = match.end()
            continue
        start = match.end()
        try:
            _, end = decode_json_at(text, start)
        except JSONTextError:  # not ended yet (or never: cut at max_tokens)
            spans.append(CallSpan(name, start, None))
            break
        spans.append(CallSpan(name, start, end))
        at = end
    return spans


def name_without_arguments(text: str, at: int = 0) -> str | None:
    """The name of the last call head in ``text[at:]`` whose name is out (its closing quote) while its arguments
    key is not (an output cut there, at ``max_tokens``); None when there is none or its name does not read."""
    heads = list(_NAME_ONLY.finditer(text, at))
    return _name(heads[-1].group(1)) if heads else None


def _name(quoted: str) -> str | None:
    """A call head's name as written between its quotes, JSON escapes read (None: an escape that does not read)."""
    try:
        name = load_json(f'"{quoted}"')
    except JSONTextError:
        return None
    return name if isinstance(name, str) else None
