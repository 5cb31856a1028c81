"""Tool calls found in what a model wrote freely (``tool_choice: "auto"``), one parser per checkpoint family's
format, as vLLM's ``--tool-call-parser``:

- ``hermes`` (Hermes 2 Pro, Qwen2 / Qwen2.5, and most chat templates with tool support): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; the text before the first is the content.
- ``llama3_json`` (Llama 3.1 / 3.2): the whole answer is one call ``{"name": ..., "parameters": {...}}``, or
  several separated by ``;``, optionally after ``<|python_tag|>``; anything else is plain content.

:func:`parser_name` picks one from a checkpoint's decoder (``api.tool_call_parser: auto``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from mm_serve.ground.json_text import JSONTextError, decode_json_at, load_json
from mm_serve.protocol.call_spans import CallSpan, call_spans
from mm_serve.protocol.tools import FunctionCall, ToolCall

Parsed = tuple[str | None, list[ToolCall]]  # (content, calls)
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _call(obj: object, arguments_key: str, raw: str | None = None) -> ToolCall | None:
    """The call ``obj`` (a parsed JSON object) names, None if it names none. Its arguments are ``raw``, their
    text as written (:func:`~mm_serve.protocol.call_spans.call_spans`: what a stream sent), when that was
    found; else the parsed value written again as JSON."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if raw is not None and isinstance(arguments, dict) and json.loads(raw) == arguments:
        return ToolCall(function=FunctionCall(name=obj["name"], arguments=raw))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCall(function=FunctionCall(name=obj["name"], arguments=text))


def _raw_arguments(body: str, key: str, at: int = 0) -> str | None:
    """The text of the arguments of the call object at ``body[at:]``, if it has the usual head (name first)."""
    spans = call_spans(body, key, at, limit=1)
    return spans[0].arguments(body) if spans and spans[0].end is not None else None


def parse_hermes(text: str) -> Parsed:
    """Calls in ``<tool_call>`` blocks (the last may lack its closing tag); unparsable blocks are skipped.
    With no call, the whole text is the content."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES.findall(text[start:]):
        try:
            call = _call(load_json(body), "arguments", _raw_arguments(body, "arguments"))
        except JSONTextError:
            call = None
        if call is not None:
            calls.append(call)
    if not calls:
        return text, []
    content = text[:start]  # as vLLM's hermes parser: the text before the first block, None when blank
    return content if content.strip() else None, calls


def parse_llama3_json(text: str) -> Parsed:
    """The answer as one or more ``;``-separated JSON calls (``parameters``), else plain content."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls, at = [], 0
    while at < len(body):
        try:
            obj, end = decode_json_at(body, at)
        except JSONTextError:
            return text, []
        call = _call(obj, "parameters", _raw_arguments(body, "parameters", at))
        if call is None:
            return text, []
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return None, calls


PARSERS: dict[str, Callable[[str], Parsed]] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}
HERMES_START = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"


def sure_content(parser: str, text: str) -> int:
    """How many characters at the start of ``text`` (an output so far) are content whatever comes next, so a
    stream may send them: ``hermes``, the text before a ``<tool_call>`` (or before what may be the start of
    one at its end); ``llama3_json``, all of it once it starts with something other than a call (``{`` or
    ``<|python_tag|>``), else nothing. Blank text is never sure (an answer that is only calls has no
    content)."""
    if parser == "hermes":
        start = text.find(HERMES_START)
        if start < 0:
            start = len(text)
            for keep in range(min(len(HERMES_START) - 1, len(text)), 0, -1):
                if text.endswith(HERMES_START[:keep]):
                    start = len(text) - keep
                    break
    else:
        head = text.lstrip()
        call_like = head.startswith("{") or head.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(head)
        start = 0 if call_like else len(text)
    return start if text[:start].strip() else 0


def growing_calls(parser: str, text: str) -> list[tuple[int, CallSpan]]:
    """The calls ``parser`` would read in ``text`` (an output so far) whose head is out, each with the offset
    its span is relative to (``span.arguments(text[offset:])``): for a stream's argument deltas. ``hermes``:
    one per ``<tool_call>`` block (read up to its ``</tool_call>`` once that is out); ``llama3_json``: the
    ``;``-separated calls of an answer that starts as one."""
    if parser == "hermes":
        found: list[tuple[int, CallSpan]] = []
        at = text.find(HERMES_START)
        while at >= 0:
            close = text.find("</tool_call>", at)
            block = text[: close if close >= 0 else len(text)]
            found.extend((0, span) for span in call_spans(block, "arguments", at + len(HERMES_START), limit=1)
                         if close < 0 or span.end is not None)  # a closed block whose arguments never ended: none
            at = text.find(HERMES_START, close) if close >= 0 else -1
        return found
    head = text.lstrip()
    if head.startswith(PYTHON_TAG):
        head = head[len(PYTHON_TAG):].lstrip()
    if not head.startswith("{"):
        return []
    offset = len(text) - len(head)
    return [(offset, span) for span in call_spans(head, "parameters")]


def parser_name(configured: str, decoder_type: str) -> str:
    """The parser to use: ``configured`` unless it is ``auto``; then ``llama3_json`` for a Llama decoder and
    ``hermes`` for the rest (Qwen2, Mistral and most templates with tools write Hermes-style blocks)."""
    if configured != "auto":
        return configured
    return "llama3_json" if decoder_type == "llama" else "hermes"
