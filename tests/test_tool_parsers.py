"""The tool-call parsers on outputs as the model families write them (Qwen2.5 / Hermes 2 Pro blocks, Llama 3.1
JSON), and the grammar of a required or named tool choice."""

from __future__ import annotations

import json

import pytest

from mm_serve.protocol.tool_parsers import (
    parse_hermes,
    parse_llama3_json,
    parser_name,
    sure_content,
)
from mm_serve.protocol.tools import (
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    Tool,
    ToolError,
    constrained_calls,
    partial_calls,
    tool_grammar,
    tool_mode,
)

QWEN_TWO_CALLS = ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                  '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": '
                  '"Europe/Paris"}}\n</tool_call>')
HERMES_UNCLOSED = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}'
LLAMA_ONE = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TWO = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'


def _calls(parsed: tuple) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in parsed[1]]


def test_hermes_reads_every_block_and_keeps_the_text_before_as_content() -> None:
    parsed = parse_hermes(QWEN_TWO_CALLS)
    assert parsed[0] == "I will look both up.\n"  # the text before the first block, as vLLM's parser
    assert _calls(parsed) == [("get_weather", {"city": "Paris", "unit": "celsius"}),
                              ("get_time", {"tz": "Europe/Paris"})]
    assert _calls(parse_hermes(HERMES_UNCLOSED)) == [("get_time", {"tz": "UTC"})]
    assert parse_hermes(HERMES_UNCLOSED)[0] is None
    assert parse_hermes("no call here") == ("no call here", [])
    assert parse_hermes("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    first, second = parse_hermes(QWEN_TWO_CALLS)[1]
    assert first.id != second.id and first.id.startswith("call_")


def test_llama3_json_reads_one_or_several_calls_and_nothing_from_prose() -> None:
    assert _calls(parse_llama3_json(LLAMA_ONE)) == [("get_weather", {"city": "Paris"})]
    assert parse_llama3_json(LLAMA_ONE)[0] is None
    assert _calls(parse_llama3_json(LLAMA_TWO)) == [("a", {"x": 1}), ("b", {})]
    assert parse_llama3_json("The weather is fine.") == ("The weather is fine.", [])
    assert parse_llama3_json('{"city": "Paris"}') == ('{"city": "Paris"}', [])  # JSON, but not a call
    assert parse_llama3_json(LLAMA_ONE + " and more") == (LLAMA_ONE + " and more", [])


def test_the_parser_follows_the_decoder_unless_configured() -> None:
    assert parser_name("auto", "llama") == "llama3_json"
    assert parser_name("auto", "qwen2") == "hermes" and parser_name("auto", "mistral") == "hermes"
    assert parser_name("hermes", "llama") == "hermes"


TOOLS = [Tool(type="function", function=FunctionDef(name="get_weather", parameters={
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})),
    Tool(type="function", function=FunctionDef(name="get_time"))]


def test_tool_modes_and_their_grammars() -> None:
    named = NamedToolChoice(type="function", function=NamedFunction(name="get_weather"))
    assert tool_mode(TOOLS, None) == "auto" and tool_mode(TOOLS, "none") is None
    assert tool_mode(TOOLS, "required") == "required" and tool_mode(TOOLS, named) == "named"
    assert tool_grammar(TOOLS, named, True) == ("json", json.dumps(TOOLS[0].function.parameters))
    kind, text = tool_grammar(TOOLS, "required", False)  # type: ignore[misc]
    schema = json.loads(text)
    assert kind == "json" and schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [o["properties"]["name"]["const"] for o in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert "maxItems" not in json.loads(tool_grammar(TOOLS, "required", True)[1])  # type: ignore[index]
    assert tool_grammar(TOOLS, "auto", True) is None
    with pytest.raises(ToolError, match="not among the tools"):
        tool_mode(TOOLS, NamedToolChoice(type="function", function=NamedFunction(name="nope")))
    with pytest.raises(ToolError, match="needs tools"):
        tool_mode(None, "required")


def test_constrained_outputs_become_calls() -> None:
    (call,) = constrained_calls("named", '{"city": "Oslo"}', "get_weather")  # type: ignore[misc]
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Oslo"}')
    calls = constrained_calls("required", '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", '
                                          '"parameters": {"city": "Rome"}}]', None)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls or []] == [
        ("get_time", {}), ("get_weather", {"city": "Rome"})]
    assert constrained_calls("named", '{"city": "Os', "get_weather") is None  # cut at max_tokens


@pytest.mark.parametrize("text,calls", [
    ('[{"name": "get_x", "par', [("get_x", "")]),  # was no call, the JSON given as content
    ('[{"name": "get_x", "parameters": ', [("get_x", "")]),
    ('[{"name": "get_x", "parameters": {"a": 1', [("get_x", '{"a": 1')]),
    ('[{"name": "get_x", "parameters": {}}, {"name": "get_y"', [("get_x", "{}"), ("get_y", "")]),
    ('[{"name": "get_', []),  # no name yet
])
def test_a_required_call_cut_after_its_name_has_one_shape(text: str, calls: list[tuple[str, str]]) -> None:
    """Cut at max_tokens anywhere after a call's name, the call is there with its arguments so far."""
    assert [(c.function.name, c.function.arguments) for c in partial_calls("required", text, None)] == calls


@pytest.mark.parametrize("parser,text,sure", [
    ("hermes", "Sure, one moment.", 17),
    ("hermes", "Sure.\n<tool_", 6),  # the end may become a <tool_call>
    ("hermes", "Sure.\n<tool_call>{\"name\"", 6),
    ("hermes", "\n<tool_call>{", 0),  # only blank text before the call: no content
    ("hermes", "a <toolbox", 10),
    ("llama3_json", "The answer is 4", 15),
    ("llama3_json", '  {"name": "f"', 0),
    ("llama3_json", "<|python", 0),
    ("llama3_json", "<|pyx", 5),
])
def test_what_a_stream_may_send_as_content_before_the_end(parser: str, text: str, sure: int) -> None:
    assert sure_content(parser, text) == sure


@pytest.mark.parametrize("text", [QWEN_TWO_CALLS, HERMES_UNCLOSED, "plain text <tool", "x <tool_call>{bad}"])
def test_the_content_a_hermes_stream_sends_never_passes_the_answer_s_content(text: str) -> None:
    """Growing the text a character at a time, what is sure is a prefix of the final content (or of the
    text, when it holds no call)."""
    content, calls = parse_hermes(text)
    final = (content or "") if calls else text
    sent = 0
    for end in range(len(text) + 1):
        sent = max(sent, sure_content("hermes", text[:end]))
        assert final.startswith(text[:sent]), (end, text[:sent])


REQUIRED_TWO = ('[{"name": "get_weather", "parameters": {"city": "Pa\\"ris }", "unit": "celsius"}}, '
                '{"name": "get_time", "parameters": {"tz": "UTC"}}]')


def _grown(parser: str, text: str) -> tuple[list[tuple[str, str]], int]:
    """Feed ``text`` one character at a time to :func:`growing_calls` (``required``: :func:`call_spans` with
    ``parameters``), as a stream would: the (name, arguments) each call's pieces add up to, and how many
    argument pieces there were. A call's arguments only ever grow."""
    from mm_serve.protocol.call_spans import call_spans
    from mm_serve.protocol.tool_parsers import growing_calls

    seen: list[list[str]] = []
    pieces = 0
    for n in range(1, len(text) + 1):
        prefix = text[:n]
        spans = [(0, s) for s in call_spans(prefix, "parameters")] if parser == "required" else \
            growing_calls(parser, prefix)
        for k, (offset, span) in enumerate(spans):
            arguments = span.arguments(prefix[offset:])
            if k == len(seen):
                seen.append([span.name, ""])
            assert seen[k][0] == span.name and arguments.startswith(seen[k][1]), (prefix, seen)
            pieces += arguments != seen[k][1]
            seen[k][1] = arguments
    return [(name, arguments) for name, arguments in seen], pieces


@pytest.mark.parametrize("parser,text,parse", [
    ("hermes", QWEN_TWO_CALLS, parse_hermes),
    ("hermes", HERMES_UNCLOSED, parse_hermes),
    ("llama3_json", LLAMA_ONE, parse_llama3_json),
    ("llama3_json", LLAMA_TWO, parse_llama3_json),
    ("required", REQUIRED_TWO, lambda t: (None, constrained_calls("required", t, None))),
], ids=["hermes-two", "hermes-unclosed", "llama-one", "llama-two", "required-two"])
def test_arguments_read_as_they_are_written_add_up_to_the_parsed_calls(parser: str, text: str, parse) -> None:  # type: ignore[no-untyped-def]
    """Recorded outputs of each format, a character at a time: every call is announced once its name is out,
    its arguments grow piece by piece (a brace inside a string does not end them), and they add up to
    exactly the arguments text of the parsed answer (what the JSON answer carries)."""
    grown, pieces = _grown(parser, text)
    parsed = [(c.function.name, c.function.arguments) for c in parse(text)[1]]
    assert grown == parsed and pieces >= sum(len(a) for _, a in parsed) // 2
    assert all(json.loads(arguments) is not None for _, arguments in grown)


def test_a_hermes_block_whose_arguments_never_end_streams_no_call() -> None:
    from mm_serve.protocol.tool_parsers import growing_calls

    bad = '<tool_call>{"name": "f", "arguments": {"x": }</tool_call>'
    assert growing_calls("hermes", bad) == [] and parse_hermes(bad)[1] == []
    assert [s.name for _, s in growing_calls("hermes", bad + QWEN_TWO_CALLS)] == ["get_weather", "get_time"]
