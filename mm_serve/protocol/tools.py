"""Tool calling on chat completions: the ``tools`` a call declares, its ``tool_choice``, the grammar that
enforces a required or named choice, and the ``tool_calls`` of the answer.

How each ``tool_choice`` is served (vLLM's scheme):

- ``"none"``: the tools are rendered into the prompt by the chat template, the answer is text.
- ``"auto"`` (the default when tools are given): the model writes freely; the checkpoint family's parser
  (:mod:`mm_serve.protocol.tool_parsers`) finds the calls in what it wrote.
- ``{"type": "function", "function": {"name": N}}``: the output is constrained to a JSON object valid
  against ``N``'s ``parameters`` schema; it is the call's arguments.
- ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}`` objects, one per
  call, each name a declared function and its parameters valid against that function's schema (one call
  unless ``parallel_tool_calls``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from mm_serve.ground.json_text import JSONTextError, load_json
from mm_serve.protocol.call_spans import call_spans, name_without_arguments

GrammarSpec = tuple[str, str]


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A call in an answer (and in an assistant message of the history)."""

    model_config = ConfigDict(extra="ignore")
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


class StreamDelta(BaseModel):
    """A piece of a streamed answer: a field it does not carry is left out, not sent null, as OpenAI's are
    (the SDK's stream helper takes a tool call's ``"type": null`` for a change of type and fails)."""

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(StreamDelta):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(StreamDelta):
    """A streamed piece of a call: the first carries its ``id``, ``type`` and ``name``, the rest only their
    ``index`` and argument text (OpenAI's stream format: absent keys, not nulls)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ToolError(ValueError):
    """The tool fields of a call are inconsistent; ``param`` names the field (a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _parameters(function: FunctionDef) -> dict[str, Any]:
    """The schema of ``function``'s arguments; a function declared without ``parameters`` takes none: ``{}``.
    Arguments are a JSON object whatever the schema: one that names no type, ``{}`` included (which any JSON
    value matches: a call's arguments came out as ``9``), is given ``"type": "object"``."""
    if function.parameters is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    if any(key in function.parameters for key in ("type", "$ref", "anyOf", "oneOf", "allOf", "enum", "const")):
        return function.parameters
    return {**function.parameters, "type": "object"}


def tool_mode(tools: list[Tool] | None, choice: ToolChoice | None) -> str | None:
    """``"named"``, ``"required"``, ``"auto"`` or None (no tools, or ``"none"``): how the answer's calls are
    made (module docstring).

    Raises:
        ToolError: a ``tool_choice`` other than ``"none"`` without tools, or naming an undeclared function; two
            tools of one name.
    """
    names = [t.function.name for t in tools or []]
    if len(set(names)) < len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise ToolError(f"two tools are named {twice!r}; each function needs a name of its own", "tools")
    if not tools:
        if choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    if choice is None or choice == "auto":
        return "auto"
    if choice == "none":
        return None
    if choice == "required":
        return "required"
    assert isinstance(choice, NamedToolChoice)
    if choice.function.name not in {t.function.name for t in tools}:
        raise ToolError(f"tool_choice names the function {choice.function.name!r}, which is not among the tools",
                        "tool_choice")
    return "named"


def tool_grammar(tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> GrammarSpec | None:
    """The JSON-schema grammar that enforces a named or required ``choice`` over ``tools`` (None otherwise)."""
    mode = tool_mode(tools, choice)
    if mode == "named":
        assert isinstance(choice, NamedToolChoice)
        function = next(t.function for t in tools if t.function.name == choice.function.name)
        return "json", json.dumps(_parameters(function))
    if mode != "required":
        return None
    one = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                       "parameters": _parameters(t.function)},
                      "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}
    schema: dict[str, Any] = {"type": "array", "items": one, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return "json", json.dumps(schema)


def partial_calls(mode: str, text: str, named: str | None) -> list[ToolCall]:
    """The calls of an output made under a named or required grammar and cut short (at ``max_tokens``), as
    far as they were written: named, the text is its arguments so far; required, each call whose name is
    out, with its arguments so far (:func:`~mm_serve.protocol.call_spans.call_spans`), ``""`` for one cut
    before its arguments key (so a cut call has one shape wherever the cut falls after its name)."""
    if mode == "named":
        return [ToolCall(function=FunctionCall(name=str(named), arguments=text))] if text else []
    spans = call_spans(text, "parameters")
    calls = [ToolCall(function=FunctionCall(name=s.name, arguments=s.arguments(text))) for s in spans]
    if not spans or spans[-1].end is not None:
        name = name_without_arguments(text, (spans[-1].end or 0) if spans else 0)
        if name is not None:
            calls.append(ToolCall(function=FunctionCall(name=name, arguments="")))
    return calls


def constrained_calls(mode: str, text: str, named: str | None) -> list[ToolCall] | None:
    """The calls of an output made under a named or required grammar, or None when it does not parse (an
    output cut at ``max_tokens``)."""
    try:
        value = load_json(text)
    except JSONTextError:
        return None
    if mode == "named":  # the text itself: streamed argument deltas add up to it
        return [ToolCall(function=FunctionCall(name=str(named), arguments=text))]
    if not isinstance(value, list):
        return None
    calls = [c for c in value if isinstance(c, dict) and "name" in c and "parameters" in c]
    spans = call_spans(text, "parameters")
    if len(spans) == len(calls) and all(s.end is not None and s.name == c["name"] for s, c in zip(spans, calls, strict=True)):
        # the arguments as written: what a stream sent as argument deltas
        return [ToolCall(function=FunctionCall(name=s.name, arguments=s.arguments(text))) for s in spans]
    return [ToolCall(function=FunctionCall(name=c["name"], arguments=json.dumps(c["parameters"]))) for c in calls]
