"""Tool calls with the official openai client: a required and a named tool choice give calls of declared
functions with arguments valid against their schemas, streamed deltas add up to the same calls, the
follow-up turn with the tool's answer is taken; the 400s; and tools rendered by a chat template that
knows them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from mm_serve.inputs.input_processor import InputProcessor
from mm_serve.models.registry import load_model_config
from tests.api.server_process import ServerProcess, chat_error

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "Europe/Paris", "Asia/Tokyo"]}},
        "required": ["tz"], "additionalProperties": False}
TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                "parameters": WEATHER}},
              {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                                "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES: Any = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _valid(calls: Any) -> list[tuple[str, str]]:
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        out.append((call.function.name, call.function.arguments))
    return out


def _streamed(client: openai.OpenAI, pieces: list[int] | None = None,
              **kwargs: Any) -> tuple[list[tuple[str, str]], str | None]:
    """The calls a stream's deltas add up to (by index: id, name and argument pieces), and its finish reason;
    the number of argument pieces of each call appended to ``pieces``."""
    calls: dict[int, dict[str, str]] = {}
    counts: dict[int, int] = {}
    reason = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += delta.id or ""
                entry["name"] += (delta.function.name or "") if delta.function else ""
                entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
                counts[delta.index] = counts.get(delta.index, 0) + bool(delta.function and delta.function.arguments)
    assert all(c["id"].startswith("call_") for c in calls.values())
    if pieces is not None:
        pieces.extend(counts[k] for k in sorted(counts))
    return [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], reason


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_are_valid_streamed_or_not(client: openai.OpenAI, choice: Any) -> None:
    """Sampled, four seeds; odd seeds allow parallel calls (a random model may append calls to the array until
    max_tokens; these seeds close it, and two of them make two calls). Streamed, the calls' arguments come in
    pieces as they are written (not whole at the end), and add up to the JSON answer's. How many pieces a call
    gets depends on timing (tokens decoded while the stream waits on a busy machine go out as one delta: a
    short call came in 2 during the full suite), so the count is asked of the longest; the parsers' unit
    tests check the reading token by token."""
    pieces: list[int] = []
    for seed in range(4):
        kwargs: Any = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice,
                       "max_tokens": 200, "temperature": 1.0, "seed": seed, "parallel_tool_calls": seed % 2 == 1}
        r = client.chat.completions.create(**kwargs)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        calls = _valid(r.choices[0].message.tool_calls)
        assert len(calls) >= 1 and (seed % 2 == 1 or len(calls) == 1)
        if isinstance(choice, dict):
            assert [name for name, _ in calls] == ["get_time"]
        assert _streamed(client, pieces, **kwargs) == (calls, "tool_calls")
    assert min(pieces) >= 1 and max(pieces) >= 3, pieces


def test_the_sdk_s_stream_helper_reassembles_streamed_calls(client: openai.OpenAI, server: ServerProcess) -> None:
    """``client.chat.completions.stream`` (the SDK's own reassembly, with its ``done`` events) gives the calls of
    the JSON answer. A later piece of a call leaves out ``id``, ``type`` and ``name`` rather than sending them
    null (``chat.completions.stream`` takes ``"type": null`` for a new type and fails its assertion). The
    stream of a forced call opens with no ``content``, so the reassembled message's content is None, not ``""``."""
    kwargs: Any = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                   "max_tokens": 200, "temperature": 1.0, "seed": 1, "parallel_tool_calls": True}
    answer = _valid(client.chat.completions.create(**kwargs).choices[0].message.tool_calls)
    with client.chat.completions.stream(**kwargs) as stream:
        done = [(e.name, e.arguments) for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert done == answer == _valid(final.choices[0].message.tool_calls)
    assert final.choices[0].message.content is None  # a forced call's stream opens with no content, as OpenAI's
    body = {**kwargs, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as r:
        deltas = [d for line in r.iter_lines() if line.startswith("data: {")
                  for c in json.loads(line[6:])["choices"] for d in c["delta"].get("tool_calls", [])]
    assert all(None not in d.values() and None not in d["function"].values() for d in deltas), deltas
    assert any(set(d) == {"index", "function"} for d in deltas)  # a later piece: argument text only


def test_a_required_choice_among_the_most_tools_is_served(client: openai.OpenAI, server: ServerProcess) -> None:
    """``api.max_tools`` (128) small tools under tool_choice required: the grammar (~29 KB) is under the limit
    and travels to the decode worker with the request."""
    tools: Any = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}} for i in range(128)]
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=tools, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=60, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls or []
    assert call.function.name in {f"f{i}" for i in range(128)} and isinstance(json.loads(call.function.arguments)["x"], int)
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"


def test_the_follow_up_turn_with_the_tool_answer_is_taken(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       max_tokens=200, temperature=0)
    call = r.choices[0].message.tool_calls[0]  # type: ignore[index]
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": "sunny, 21 C"})}]
    follow = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=8, temperature=0)
    assert follow.choices[0].finish_reason in ("stop", "length") and not follow.choices[0].message.tool_calls
    auto = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert auto.choices[0].message.content == follow.choices[0].message.content  # no call in what it wrote


def test_an_auto_choice_streams_its_text_as_it_comes(client: openai.OpenAI) -> None:
    """With tools and tool_choice auto, an answer that holds no call streams as content deltas (not held to the
    end), adding up to the JSON answer's content. Deltas that pile up while the client reads are sent as one
    (a stalled reader can see a whole short answer in a few pieces), so a try counts when it saw more than 3;
    an answer held to the end is one piece on every try."""
    kwargs: Any = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 100, "temperature": 0}
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.tool_calls is None or not full.choices[0].message.tool_calls
    counts = []
    for _ in range(3):
        pieces = [c.choices[0].delta.content for c in client.chat.completions.create(stream=True, **kwargs)
                  if c.choices and c.choices[0].delta.content]
        assert "".join(pieces) == full.choices[0].message.content
        counts.append(len(pieces))
        if len(pieces) > 3:
            break
    assert max(counts) > 3, counts


def test_an_auto_call_whose_arguments_are_a_json_string_streams_them_decoded(client: openai.OpenAI) -> None:
    """A model may write a call's arguments as a JSON string (``"parameters": "{\\"tz\\": ..."``): the answer
    decodes it, and the stream sends that decoded text at the end instead of the quoted text as written (it
    sent the quotes and backslashes). The output is forced with a grammar (llama3_json, the tiny model's)."""
    forced = '{"name": "get_time", "parameters": "{\\"tz\\": \\"UTC\\"}"}'
    grammar = "root ::= " + json.dumps(forced)
    kwargs: Any = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 60, "temperature": 0,
                   "extra_body": {"guided_grammar": grammar}}
    full = client.chat.completions.create(**kwargs)
    calls = [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls or []]
    assert calls == [("get_time", '{"tz": "UTC"}')] and full.choices[0].finish_reason == "tool_calls"
    assert _streamed(client, **kwargs) == (calls, "tool_calls")


@pytest.mark.parametrize("body,param,code", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", None),
    ({"tool_choice": "required"}, "tool_choice", None),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", None),
    ({"tools": [TOOLS[0]] * 129}, "tools", "tools_limit"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", None),
    ({"messages": MESSAGES + [{"role": "tool", "content": "42"}]}, "messages", None),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", None),  # two functions of one name
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function", None),
])
def test_bad_tool_fields_are_400s_naming_the_field(server: ServerProcess, body: dict, param: str,
                                                    code: str | None) -> None:
    """The field as the JSON names it (``tool_choice.function``, no pydantic model name between)."""
    error = chat_error(server, {"messages": MESSAGES, **body})
    assert (error["param"] == param or error["param"].startswith(param + ".")) and error["code"] == code, error
    assert not any(part[:1].isupper() for part in error["param"].split(".")), error


HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{% if m.content is string %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_tools_and_the_history_s_calls_reach_a_template_that_renders_them(tiny_llava: Path, tmp_path: Path) -> None:
    """A checkpoint whose chat template renders tools (Hermes style): the prompt holds each tool's schema,
    the assistant's earlier call with its arguments as an object, and the tool's answer."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llava, model)
    (model / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    processor = InputProcessor(model, load_model_config(model))
    history = MESSAGES + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}]
    prompt = processor.render_chat(history, tools=TOOLS)[0]
    assert json.dumps(TOOLS[0], ensure_ascii=False) in prompt or '"get_weather"' in prompt
    assert '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>' in prompt
    assert "<|tool|>12:00" in prompt and prompt.endswith("<|assistant|>")


def test_an_auto_call_of_an_undeclared_function_is_text(client: openai.OpenAI) -> None:
    """The model (forced here by a regex) writes a Llama-3 JSON call of a function the request did not
    declare: the answer is that text as content, with no tool call, streamed or not."""
    text = '{"name": "rm_rf", "parameters": {}}'
    kwargs: Any = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 40, "temperature": 0,
                   "extra_body": {"guided_regex": re.escape(text)}}
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_calls_cut_by_max_tokens_are_the_same_streamed_or_not(client: openai.OpenAI, choice: Any) -> None:
    """Cut at 30 tokens, a forced choice's answer has ``finish_reason`` length and the calls as far as they
    were written (the last one's arguments cut), the same calls a stream's deltas add up to."""
    kwargs: Any = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "max_tokens": 30,
                   "temperature": 0}
    r = client.chat.completions.create(**kwargs)
    calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []]
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content is None and calls
    assert _streamed(client, **kwargs) == (calls, "length")


def test_a_forced_choice_cut_before_a_name_has_no_content_and_one_cut_by_a_stop_string_says_stop(
        client: openai.OpenAI) -> None:
    """Required, cut at 3 tokens (``[{"``, no name yet): no call and no content (the grammar's text was
    given as content), streamed or not. Named, cut by a stop string inside its arguments: the call as far
    as written with ``finish_reason`` stop (not tool_calls: its arguments are no whole JSON)."""
    kwargs: Any = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 3,
                   "temperature": 0}
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content is None
    assert not r.choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert not any(c.choices and (c.choices[0].delta.content or c.choices[0].delta.tool_calls) for c in chunks)
    named: Any = {**kwargs, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                  "max_tokens": 60, "stop": ['"unit"']}
    r = client.chat.completions.create(**named)
    (call,) = r.choices[0].message.tool_calls or []
    assert r.choices[0].finish_reason == "stop" and call.function.name == "get_weather"
    assert '"unit"' not in call.function.arguments
    assert _streamed(client, **named) == ([("get_weather", call.function.arguments)], "stop")
