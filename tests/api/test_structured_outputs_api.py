"""Structured outputs with the official openai client: JSON schemas of every kind (parsed and validated with
``jsonschema``), JSON objects, regular expressions and choices, streamed and not, disaggregated and colocated,
through a decode-worker kill; and the 400s for what cannot be compiled."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.api.server_process import ServerProcess, chat_error, requests_counted, scrape_metrics
from tests.schemas_gen import random_schema

PROMPT = [{"role": "user", "content": "Describe the scene as JSON."}]


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _json_schema_call(client: openai.OpenAI, seed: int, stream: bool) -> tuple[str, str | None]:
    """(text, finish_reason) of a sampled chat call asking for ``random_schema(seed)``."""
    fmt: Any = {"type": "json_schema", "json_schema": {"name": f"s{seed}", "schema": random_schema(seed), "strict": True}}
    kwargs: Any = {"model": "tiny", "messages": PROMPT, "max_tokens": 200, "temperature": 1.0, "seed": seed,
                   "response_format": fmt}
    if not stream:
        r = client.chat.completions.create(**kwargs)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _run_schemas(server: ServerProcess, seeds: range) -> list[tuple[int, str, str | None]]:
    client = _client(server)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = {seed: pool.submit(_json_schema_call, client, seed, seed % 2 == 1) for seed in seeds}
        return [(seed, *future.result()) for seed, future in futures.items()]


def _assert_valid(results: list[tuple[int, str, str | None]]) -> None:
    """Every output parses and validates against its schema (nested objects, arrays, enums, required fields,
    bounded integers, numbers and strings: :func:`random_schema`), and ended because its grammar was complete."""
    for seed, text, reason in results:
        assert reason == "stop", (seed, text, reason)
        jsonschema.validate(json.loads(text), random_schema(seed))


def test_json_object_regex_and_choice(server: ServerProcess) -> None:
    """A JSON object's keys and strings have no bound, and a random model closes them only when a quote wins
    among hundreds of allowed tokens: of ten sampled calls (streamed and not) some would run out of tokens,
    and are closed on their last ones (``length``); every answer is a JSON object."""
    client = _client(server)
    reasons = []
    for seed in range(10):
        kwargs: Any = {"model": "tiny", "prompt": "a purple circle and", "max_tokens": 60, "temperature": 1.0,
                       "seed": seed, "extra_body": {"response_format": {"type": "json_object"}}}
        if seed % 2:
            chunks = list(client.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)
        else:
            r = client.completions.create(**kwargs)
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        reasons.append(reason)
        assert isinstance(json.loads(text), dict), text
    assert "length" in reasons, reasons
    r = client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=20, temperature=1.0, seed=4,  # type: ignore[arg-type]
                                       extra_body={"guided_regex": r"(red|blue) [0-9]{2}"})
    assert re.fullmatch(r"(red|blue) [0-9]{2}", r.choices[0].message.content or ""), r.choices[0].message.content
    choices = ["yes", 'no "quoted"', "maybe\nnot"]
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=20, temperature=1.0, seed=seed,  # type: ignore[arg-type]
                                           extra_body={"structured_outputs": {"choice": choices}})
        assert r.choices[0].message.content in choices


@pytest.mark.parametrize("body,param,code", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format", "invalid_grammar"),
    ({"guided_regex": "a(b"}, "guided_regex", "invalid_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", None),
    ({"guided_choice": []}, "guided_choice", None),
    ({"guided_json": "{not json"}, "guided_json", None),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", None),
    ({"guided_regex": "a" * 40_000}, "guided_regex", "grammar_limit"),
    ({"guided_json": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}}},
     "guided_json", "invalid_grammar"),  # 300 optional properties: ~0.25 s to compile, 1,000 would take 8 s
    ({"guided_json": {"type": "string", "minLength": "x"}}, "guided_json", "invalid_grammar"),
    ({"guided_json": {"type": "string", "maxLength": 2.5}}, "guided_json", "invalid_grammar"),
    ({"guided_json": {"type": "object", "patternProperties": {"^a": {"type": "integer"}}}}, "guided_json",
     "invalid_grammar"),
    ({"guided_json": {"$ref": "http://example.com/s.json"}}, "guided_json", "invalid_grammar"),
    ({"response_format": {"type": "json_object"}, "max_tokens": 1}, "max_tokens", None),  # {} needs 2
    ({"guided_json": _nested(70)}, "guided_json", "invalid_grammar"),  # 9 s at 450 levels: bounded
    ({"guided_json": {"type": "string", "pattern": "^(?!b)[ab]$"}}, "guided_json", "invalid_grammar"),
    ({"guided_json": {"type": "object", "required": ["z"]}}, "guided_json", "invalid_grammar"),
    ({"guided_json": "[" * 5000 + "]" * 5000}, "guided_json", None),  # past the JSON parser's stack
    ({"structured_outputs": {"json": "{\"a\": " * 3000 + "1" + "}" * 3000}}, "structured_outputs.json", None),
    ({"guided_grammar": "root ::= ("}, "guided_grammar", "invalid_grammar"),
    # grammars that compile but with which no output can start: no first token, not complete when empty
    ({"guided_grammar": "root ::= root"}, "guided_grammar", "invalid_grammar"),
    ({"guided_grammar": "root ::= a\na ::= root"}, "guided_grammar", "invalid_grammar"),
    ({"guided_regex": "[^\\x00-\\U0010FFFF]"}, "guided_regex", "invalid_grammar"),
    ({"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs.grammar", "invalid_grammar"),
    ({"guided_json": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}, "guided_json", "invalid_grammar"),
    ({"guided_json": {"allOf": [{"type": "string"}, {"type": "integer"}]}}, "guided_json", "invalid_grammar"),
    # keywords xgrammar would compile by ignoring one (outputs broke them: 25 for a multiple of 7 over 10)
    ({"guided_json": {"type": "integer", "multipleOf": 7, "minimum": 10}}, "guided_json", "invalid_grammar"),
    ({"guided_json": {"type": "number", "multipleOf": 3}}, "guided_json", "invalid_grammar"),
    ({"guided_json": {"type": "string", "minLength": 3, "pattern": "^(ab)+$"}}, "guided_json", "invalid_grammar"),
    ({"guided_json": {"type": "string", "format": "uri", "maxLength": 20}}, "guided_json", "invalid_grammar"),
    ({"guided_regex": "a\\ud800"}, "guided_regex", "invalid_grammar"),  # an escaped surrogate: no character
    ({"guided_json": {"type": "string", "format": "date", "pattern": "^x+$"}}, "guided_json", "invalid_grammar"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "dependencies": {"a": ["b"]}}}, "guided_json", "invalid_grammar"),
    ({"guided_json": {"type": "integer", "const": "abc"}}, "guided_json", "invalid_grammar"),
    ({"guided_json": {"enum": ["xyz"], "maxLength": 0}}, "guided_json", "invalid_grammar"),
    ({"guided_json": {"type": []}}, "guided_json", "invalid_grammar"),
])
def test_what_cannot_be_compiled_is_a_400_naming_the_field(server: ServerProcess, body: dict, param: str,
                                                            code: str | None) -> None:
    error = chat_error(server, {"messages": PROMPT, **body})
    assert error["param"] == param and error["code"] == code, error
    if code == "invalid_grammar":
        words = ("frobnicate", "parenthesis", "optional properties", "minLength", "maxLength", "patternProperties",
                 "$ref", "levels deep", "lookaround", "not in properties", "EBNF parser error", "oneOf schemas",
                 "allOf: 'type'", "multipleOf", "together", "'dependencies'", "breaks the schema's", "empty list",
                 "lone surrogate", "allows no output")
        assert any(word in error["message"] for word in words), error["message"]


DEAD_END = "root ::= [a-z] rest\nrest ::= rest"  # a first letter, then no token at all


def test_a_grammar_that_dead_ends_fails_its_own_call_alone(server: ServerProcess) -> None:
    """Calls whose grammar allows a first letter and then nothing, batched with plain calls: each ends alone
    with a 400 ``invalid_grammar`` (streamed: that error event, then [DONE]), and the plain calls beside them
    give the tokens they give alone. The decode worker's step used to fail for the whole batch (503s for
    every call in it), and a sampled dead-end row drew from no token at all; one with no output allowed at
    all is refused before any work. ``mm_serve_requests_total`` counts each call once, with the status its
    client saw (a stream's error event's)."""
    before = scrape_metrics(server.url)
    error = chat_error(server, {"messages": PROMPT, "guided_grammar": "root ::= root"})
    assert "allows no output" in error["message"], error

    def plain(i: int) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": [{"role": "user", "content": f"Count to {i}"}], "max_tokens": 24,
            "temperature": 0, "ignore_eos": True})

    def dead_end(i: int) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": PROMPT, "max_tokens": 24, "temperature": 1.0, "seed": i,
            "guided_grammar": DEAD_END})

    def streamed_dead_end() -> list[str]:
        body = {"model": "tiny", "messages": PROMPT, "max_tokens": 24, "stream": True, "guided_grammar": DEAD_END}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            return [line for line in r.iter_lines() if line]

    alone = [plain(i).json()["choices"][0]["message"]["content"] for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        plains = [pool.submit(plain, i) for i in range(4)]
        dead = [pool.submit(dead_end, i) for i in range(3)]
        stream = pool.submit(streamed_dead_end)
        assert [f.result().json()["choices"][0]["message"]["content"] for f in plains] == alone
        for f in dead:
            r = f.result()
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_grammar", r.text
            assert "its grammar allows no token after its 1 output token(s)" in r.json()["error"]["message"]
        lines = stream.result()
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: "):])["error"]
    assert last["type"] == "invalid_request_error" and last["code"] == "invalid_grammar", last
    assert requests_counted(before, scrape_metrics(server.url)) == {("length", "200"): 8, ("error", "400"): 5}


def test_pydantic_models_with_urls_constrained_strings_and_multiples_are_served(server: ServerProcess) -> None:
    """The keyword pairs pydantic writes (``Field(pattern=, min_length=, max_length=)``, ``Field(multiple_of=,
    ge=, le=)``; ``HttpUrl``: a format with lengths) are served through the official client's ``parse``, not
    refused, and every output it parses validates against the model's schema. A
    random model's URL runs past any small ``max_tokens``: that one is only asked to be served."""
    import pydantic

    class Handle(pydantic.BaseModel):
        handle: str = pydantic.Field(min_length=3, max_length=8, pattern=r"^[a-z0-9_]+$")
        step: int = pydantic.Field(multiple_of=5, ge=0, le=50)

    class Link(pydantic.BaseModel):
        url: pydantic.HttpUrl

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    for seed in range(3):
        r = client.chat.completions.parse(model="tiny", messages=PROMPT, response_format=Handle,  # type: ignore[arg-type]
                                          max_tokens=60, temperature=1.0, seed=seed)
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), Handle.model_json_schema())
        assert r.choices[0].message.parsed is not None and r.choices[0].message.parsed.step % 5 == 0
    with pytest.raises(openai.LengthFinishReasonError):  # served (not a 400), cut by max_tokens
        client.chat.completions.parse(model="tiny", messages=PROMPT, response_format=Link, max_tokens=8,  # type: ignore[arg-type]
                                      temperature=0)


@pytest.mark.parametrize("field,value", [("guided_choice", ["\ud800a", "b"]), ("guided_regex", "a\ud800"),
                                         ("guided_grammar", 'root ::= "\ud800"')])
def test_a_grammar_with_a_lone_surrogate_is_a_400(server: ServerProcess, field: str, value: object) -> None:
    """JSON's ``\\ud800`` escape is half a UTF-16 pair, no character: it has no UTF-8 form, xgrammar's input
    (a 400, not a 500). The body is sent ASCII-escaped, as JSON allows."""
    body = json.dumps({"model": "tiny", "messages": PROMPT, "max_tokens": 3, field: value})  # ensure_ascii
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["code"] == "invalid_grammar" and "lone surrogate" in error["message"]


def test_a_history_call_with_arguments_nested_past_the_parser_is_taken_as_text(server: ServerProcess) -> None:
    deep = "[" * 5000 + "]" * 5000
    history = PROMPT + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": deep}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}, {"role": "user", "content": "and?"}]
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": history, "max_tokens": 3})
    assert r.status_code in (200, 400), r.text  # the template's own limits may refuse it; never a 500
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"


@pytest.mark.parametrize("body,check", [
    ({"guided_json": {"type": "integer", "minimum": 0, "maximum": 999, "description": "x" * 30_000}},  # near
     # the limit: its hand-off fits
     lambda text: isinstance(json.loads(text), int)),
    ({"guided_json": {"const": {"type": "string", "maxLength": 2}}},  # a value, not a schema: left as it is
     lambda text: json.loads(text) == {"type": "string", "maxLength": 2}),
    ({"guided_choice": ["a\u0000b", "tab\there"]}, lambda text: text in ["a\u0000b", "tab\there"]),
    ({"guided_choice": ["yes", "no"], "min_tokens": 10}, lambda text: text in ["yes", "no"]),  # the grammar wins
    ({"guided_grammar": 'root ::= "yes" | "no" | "maybe"'}, lambda text: text in ["yes", "no", "maybe"]),
    ({"structured_outputs": {"grammar": 'root ::= [0-9] [0-9]? "!"'}}, lambda text: re.fullmatch(r"\d\d?!", text)),
    ({"guided_json": {"type": "integer", "allOf": [{"maximum": 5}], "minimum": 2}},  # allOf merged with its siblings
     lambda text: 2 <= json.loads(text) <= 5),
    ({"guided_grammar": 'root ::= ""', "ignore_eos": True}, lambda text: text == ""),  # complete at once: no token
])
def test_grammars_at_the_edges_are_served(server: ServerProcess, body: dict, check: Any) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": PROMPT, "max_tokens": 60, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and check(choice["message"]["content"]), choice
    if body.get("ignore_eos"):
        assert r.json()["usage"]["completion_tokens"] == 0  # not an arbitrary token the grammar refuses
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"


@pytest.fixture(params=["disaggregated", "colocated"])
def faulty(tiny_llava: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    config = tmp_path / "fault.yaml"
    # no refusal by prediction: the restarted worker's first steps, slowed by 8 grammar compiles beside them on
    # a busy machine, may price a TPOT past the SLO (a 429 is then right, and not what this test is about)
    config.write_text(f"mode: {request.param}\n"
                      "fault:\n  heartbeat_timeout_s: 2.0\n  restart_backoff_s: 0.1\n  max_migrations: 3\n"
                      "admission:\n  predict: false\n")
    proc = ServerProcess(tiny_llava, "--config", str(config), log_dir=tmp_path)
    proc.wait_ready()
    proc.mode = request.param  # type: ignore[attr-defined]
    try:
        yield proc
    finally:
        assert proc.stop() == 0


def test_200_json_schemas_hold_through_a_worker_kill_in_both_modes(faulty: ServerProcess) -> None:
    """200 schema calls (half streamed), 8 in flight, with the worker that decodes (the decode worker, or the
    colocated one) SIGKILLed once 400 tokens are out: the requests it held migrate, their grammars rebuilt
    from the tokens already streamed; every output parses, validates and ended because its grammar was
    complete."""
    role = "decode0" if faulty.mode == "disaggregated" else "colocated0"  # type: ignore[attr-defined]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(_run_schemas, faulty, range(100, 300))
        while not running.done() and _tokens_out(faulty) < 400:
            time.sleep(0.02)
        pid = int(httpx.get(f"{faulty.url}/internal/stats", timeout=10).json()[role]["pid"])
        os.kill(pid, signal.SIGKILL)  # read now: a slow machine may have restarted it already
        results = running.result()
    assert len(results) == 200
    _assert_valid(results)
    migrations = httpx.get(f"{faulty.url}/metrics", timeout=10).text
    assert re.search(r'mm_serve_request_migrations_total\{role="\w+"\} [1-9]', migrations), "no request migrated"


def _tokens_out(server: ServerProcess) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    found = re.search(r"^mm_serve_generation_tokens_total (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0
