"""The request fields that ask for structured output, and the one grammar they name.

OpenAI's ``response_format`` (``{"type": "json_object"}``, or ``{"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}``) and vLLM's extensions: ``guided_json`` (a schema), ``guided_regex``,
``guided_choice`` (a list of strings), ``guided_grammar`` (EBNF, in xgrammar's dialect: ``root ::= ...``),
and their newer spelling ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``). A call asks for one of them at most. :func:`grammar_of` turns the one it asks
for into the engine's ``(kind, text)`` spec (:mod:`mm_serve.runtime.structured_output`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mm_serve.ground.json_text import JSONTextError, load_json

GrammarSpec = tuple[str, str]


class StructuredOutputError(ValueError):
    """A request's structured-output fields are inconsistent; ``param`` names the field (a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def bad_request(message: str, param: str) -> StructuredOutputError:
    return StructuredOutputError(message, param)


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema (and OpenAI's name, description and strict flag, which
    change nothing here: every output follows the schema)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = Field(None, max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` object; its other members (``structural_tag``) are a 400."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """The fields of a chat or completions body that ask for structured output (unknown fields ignored)."""

    model_config = ConfigDict(extra="ignore")

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = Field(None, description="extension (vLLM): a JSON schema the output follows")
    guided_regex: str | None = Field(None, description="extension (vLLM): a regular expression the output matches")
    guided_choice: list[str] | None = Field(None, description="extension (vLLM): the output is one of these strings")
    guided_grammar: str | None = Field(None, description="extension (vLLM): an EBNF grammar (xgrammar's dialect, "
                                                         "root ::= ...) the output follows")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="extension (vLLM): {json | regex | choice | grammar | json_object}, as the guided_* fields")


def _schema_text(schema: dict[str, Any] | str | bool, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = load_json(schema)
        except JSONTextError as exc:
            raise bad_request(f"{param} must be a JSON schema (an object, or a string of JSON): {exc}",
                              param) from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema object", param)
    return json.dumps(schema)


def _choices(choices: list[str], param: str) -> str:
    if not choices or any(not c for c in choices):
        raise bad_request(f"{param} must be a non-empty list of non-empty strings", param)
    return json.dumps(choices)


def grammar_of(body: StructuredFields) -> tuple[GrammarSpec, str] | None:
    """The grammar ``body`` asks for and the field that asks, or None.

    Raises:
        StructuredOutputError: when two fields ask (naming them), a ``json_schema`` format has no schema, a schema
            is not JSON, or choices are empty.
    """
    asked: list[tuple[GrammarSpec, str]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append((("json_object", ""), "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema", "response_format")
        asked.append((("json", _schema_text(fmt.json_schema.schema_, "response_format")), "response_format"))
    if body.guided_json is not None:
        asked.append((("json", _schema_text(body.guided_json, "guided_json")), "guided_json"))
    if body.guided_regex is not None:
        asked.append((("regex", body.guided_regex), "guided_regex"))
    if body.guided_choice is not None:
        asked.append((("choice", _choices(body.guided_choice, "guided_choice")), "guided_choice"))
    if body.guided_grammar is not None:
        asked.append((("grammar", body.guided_grammar), "guided_grammar"))
    so = body.structured_outputs
    if so is not None:
        given = [(name, value) for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                                   ("grammar", so.grammar), ("json_object", so.json_object or None))
                 if value is not None]
        for name, value in given:
            param = f"structured_outputs.{name}"
            if name == "json":
                asked.append((("json", _schema_text(value, param)), param))  # type: ignore[arg-type]
            elif name == "choice":
                asked.append((("choice", _choices(value, param)), param))  # type: ignore[arg-type]
            else:
                asked.append(((name, "" if name == "json_object" else value), param))  # type: ignore[arg-type]
    if len(asked) > 1:
        names = ", ".join(param for _, param in asked)
        raise bad_request(f"ask for one structured output at most; this call asks with {names}", asked[1][1])
    return asked[0] if asked else None
