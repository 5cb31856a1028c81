"""JSON schemas with combinators: rewritten so that xgrammar enforces them exactly (checked with its own
matcher on the compiled grammar), or refused with a message naming why; never compiled into a grammar that
lets an output break them (xgrammar 0.2.9 dropped allOf of two schemas and the keywords beside a combinator)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr

from mm_serve.protocol.tools import FunctionDef, NamedToolChoice, Tool, tool_grammar
from mm_serve.runtime.structured_output import GrammarBook, GrammarError

CAT = {"type": "object", "properties": {"pet": {"const": "cat", "title": "Pet"}, "lives": {"type": "integer"}},
       "required": ["pet", "lives"]}
DOG = {"type": "object", "properties": {"pet": {"enum": ["dog", "wolf"]}}, "required": ["pet"]}


@pytest.fixture(scope="module")
def book(tiny_llava: Path) -> GrammarBook:
    return GrammarBook(tiny_llava)


def _accepts(book: GrammarBook, schema: dict[str, Any], text: str) -> bool:
    matcher = xgr.GrammarMatcher(book.compile(("json", json.dumps(schema)), 512))
    return bool(matcher.accept_string(text) and matcher.is_completed())


@pytest.mark.parametrize(("schema", "valid", "invalid"), [
    ({"type": "integer", "allOf": [{"maximum": 5}]}, ["3"], ["7", '"a"']),
    ({"allOf": [{"type": "integer"}, {"minimum": 100}]}, ["200"], ["3", '"x"']),
    ({"type": "object", "properties": {"x": {"type": "integer"}}, "anyOf": [{"required": ["x"]}]},
     ['{"x": 1}'], ["{}"]),
    ({"type": "integer", "anyOf": [{"maximum": 5}, {"minimum": 10}]}, ["3", "12"], ["7", '"a"']),
    ({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
      "allOf": [{"properties": {"m": {"type": "string"}}, "required": ["m"]}]}, ['{"n": 1, "m": "a"}'], ['{"n": 1}']),
    ({"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}], "discriminator": {"propertyName": "pet"},
      "$defs": {"Cat": CAT, "Dog": DOG}}, ['{"pet": "cat", "lives": 9}', '{"pet": "wolf"}'], ['{"pet": "cat"}']),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}, ['"a"', "1", "null"], ["1.5"]),
    ({"anyOf": [True, {"type": "string"}], "type": "integer"}, ["4"], ['"a"']),
])
def test_combinators_are_enforced_exactly(book: GrammarBook, schema: dict[str, Any], valid: list[str],
                                          invalid: list[str]) -> None:
    assert all(_accepts(book, schema, text) for text in valid)
    assert not any(_accepts(book, schema, text) for text in invalid)


@pytest.mark.parametrize(("schema", "reason"), [
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "'type' is set by two of the schemas"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf schemas 0 and 1 may both match"),
    ({"oneOf": [CAT, {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}}, "required": ["pet"]}]},
     "oneOf schemas 0 and 1 may both match"),
    ({"anyOf": []}, "anyOf holds no schema"),
    ({"anyOf": [False]}, "anyOf holds no schema"),
    ({"anyOf": [{"type": "string"}], "oneOf": [{"type": "string"}]}, "both anyOf and oneOf"),
    ({"$ref": "#/$defs/A", "maximum": 5, "$defs": {"A": {"type": "integer"}}}, "$ref beside 'maximum'"),
    ({"type": "object", "properties": {"a": {}}, "allOf": [{"additionalProperties": False}]},
     "'additionalProperties' in one of the schemas it combines and 'properties' in another"),
    ({"type": "integer", "minimum": 1e300}, "minimum 1e+300 of an integer is outside the 64-bit range"),
    ({"type": "string", "pattern": "a^b"}, "anchor (^) inside it"),
    ({"type": "string", "pattern": "ab$c"}, "anchor ($) inside it"),
])
def test_what_the_engine_would_not_enforce_is_refused(book: GrammarBook, schema: dict[str, Any], reason: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(reason)):
        book.compile(("json", json.dumps(schema)), 512)


def test_anchors_at_the_ends_and_inside_classes_are_kept(book: GrammarBook) -> None:
    for pattern in ("^a[$^]b$", r"a\^b\$", "[^$]+", "^a$|^b$", "(^a|b$)"):
        book.compile(("json", json.dumps({"type": "string", "pattern": pattern})), 512)
    with pytest.raises(GrammarError, match="anchor"):
        book.compile(("regex", "x^y"), 512)


def test_a_tool_whose_parameters_name_no_type_is_called_with_an_object() -> None:
    """``parameters: {}`` matched any JSON value: a named call's arguments came out as ``9``."""
    tools = [Tool(type="function", function=FunctionDef(name="f", parameters={})),
             Tool(type="function", function=FunctionDef(name="g", parameters={"properties": {"a": {"type": "integer"}}}))]
    for name in ("f", "g"):
        kind, text = tool_grammar(tools, NamedToolChoice(type="function", function={"name": name}), False) or ("", "")
        assert kind == "json" and json.loads(text)["type"] == "object"
