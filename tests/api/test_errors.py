"""Every bad input gets the right status and OpenAI error type; the server keeps serving."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from mm_serve.config import load_config
from mm_serve.engine.engine_holder import EngineHolder
from mm_serve.pipeline.context import ServerContext
from mm_serve.server.app import build_app
from tests.api.server_process import ServerProcess, data_uri
from tests.factories import gradient_image


def _png_bytes() -> bytes:
    buf = io.BytesIO()
    gradient_image(32, 32).save(buf, format="PNG")
    return buf.getvalue()


def _bomb_png(width: int = 60000, height: int = 60000) -> bytes:
    """A tiny PNG whose header claims ``width`` x ``height`` pixels."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b"")


def _b64(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _image_msg(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]


def _chat(**overrides: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **overrides}


PNG = _png_bytes()
CASES: list[tuple[str, Any, int]] = [
    ("malformed JSON", b'{"model": "tiny", "messages": [', 400),
    ("empty messages", _chat(messages=[]), 400),
    ("unknown role", _chat(messages=[{"role": "wizard", "content": "hi"}]), 400),
    ("unknown content part", _chat(messages=[{"role": "user", "content": [{"type": "video", "video": "x"}]}]), 400),
    ("ftp image url", _chat(messages=_image_msg("ftp://example.com/a.png")), 400),
    ("plain path image url", _chat(messages=_image_msg("/etc/passwd")), 400),
    ("file url outside allowed dir", _chat(messages=_image_msg("file:///etc/hostname")), 400),
    ("base64 that does not decode", _chat(messages=_image_msg("data:image/png;base64,@@@notbase64@@@")), 400),
    ("bytes that are not an image", _chat(messages=_image_msg(_b64(b"hello world, not an image"))), 400),
    ("truncated image", _chat(messages=_image_msg(_b64(PNG[: len(PNG) // 2]))), 400),
    ("decompression bomb", _chat(messages=_image_msg(_b64(_bomb_png()))), 400),
    ("too many images", _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _b64(PNG)}}] * 5}]), 400),
    ("max_tokens 0", _chat(max_tokens=0), 400),
    ("max_tokens not an integer", _chat(max_tokens="many"), 400),
    ("max_tokens fractional", _chat(max_tokens=2.5), 400),
    ("temperature too high", _chat(temperature=3.5), 400),
    ("temperature negative", _chat(temperature=-0.1), 400),
    ("top_p zero", _chat(top_p=0), 400),
    ("top_p above one", _chat(top_p=1.5), 400),
    ("n zero", _chat(n=0), 400),
    ("prompt plus max_tokens over context", _chat(max_tokens=10**6), 400),
    ("prompt plus max_completion_tokens over context", _chat(max_completion_tokens=10**6), 400),
    ("min_tokens over max_completion_tokens", _chat(min_tokens=5, max_completion_tokens=2), 400),
    ("content a number", _chat(messages=[{"role": "user", "content": 5}]), 400),
    ("seed out of range", _chat(seed=2**64), 400),
    ("max_tokens as a string", _chat(max_tokens="4"), 400),
    ("lone surrogate in text", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', 400),
    ("prompt far too long to tokenize", _chat(messages=[{"role": "user", "content": "x" * 300_000}]), 400),
    ("unknown model", _chat(model="gpt-nonexistent"), 404),
    ("lone surrogate in the model name", b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}', 404),
    ("lone surrogate in the completions model name", b'{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}', 404),
    ("completions with empty prompt list", {"model": "tiny", "prompt": [], "max_tokens": 2}, 400),
    ("empty body", b"", 400),
    ("stream as a string", _chat(stream="yes"), 400),
    ("temperature NaN", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400),
    ("functions (unsupported)", _chat(functions=[{"name": "f", "parameters": {}}]), 400),
    ("prediction (unsupported)", _chat(prediction={"type": "content", "content": "x"}), 400),
    ("logit_bias key not a token id", _chat(logit_bias={"five": 1}), 400),
    ("logit_bias token past the vocabulary", _chat(logit_bias={"99999999": 1}), 400),
    ("logit_bias value over 100", _chat(logit_bias={"5": 101}), 400),
    ("min_tokens over max_tokens", _chat(min_tokens=5, max_tokens=2), 400),
    ("repetition_penalty zero", _chat(repetition_penalty=0), 400),
    ("completions echo not a boolean", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "echo": "yes"}, 400),
    ("completions suffix (unsupported)", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "suffix": "end"}, 400),
    ("presence_penalty over 2", _chat(presence_penalty=2.5), 400),
    ("completions frequency_penalty under -2", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "frequency_penalty": -3}, 400),
    ("top_k beyond any vocabulary", _chat(top_k=10**30), 400),
    ("completions top_k 2**64", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "top_k": 2**64}, 400),
    ("completions best_of 0 (unsupported)", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "best_of": 0}, 400),
    ("completions best_of true (unsupported)", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "best_of": True}, 400),
    ("completions best_of 3 (unsupported)", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "best_of": 3}, 400),
    ("store (unsupported)", _chat(store=True), 400),
    ("web_search_options (unsupported)", _chat(web_search_options={"search_context_size": "high"}), 400),
    ("a refusal part in a user message", _chat(messages=[{"role": "user", "content": [
        {"type": "refusal", "refusal": "no"}]}]), 400),
    ("a prompt alone over the context", _chat(max_tokens=None, messages=[{"role": "user", "content": "word " * 2100}]),
     400),
]


@pytest.mark.parametrize("name,body,status", CASES, ids=[c[0] for c in CASES])
def test_bad_input_table(server: ServerProcess, name: str, body: Any, status: int) -> None:
    completions = "prompt" in body if isinstance(body, dict) else isinstance(body, bytes) and b'"prompt"' in body
    path = "/v1/completions" if completions else "/v1/chat/completions"
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert error["message"]
    if name == "unknown content part":
        assert "video" in error["message"] or "tag" in error["message"], error["message"]
    if name == "empty body":
        assert error["message"] == "request body is missing: send a JSON object", error["message"]
    if name == "temperature NaN":
        assert "finite" in error["message"], error["message"]
    if name == "lone surrogate in text":
        assert "not valid Unicode" in error["message"] and "TextEncodeInput" not in error["message"]
    if "(unsupported)" in name:
        param = name.split()[1] if name.startswith("completions") else name.split()[0]
        accepted = {"best_of": ": only 1 (the default) is accepted", "modalities": ': only ["text"] is accepted',
                    "function_call": ': only "none" or "auto" is accepted',
                    "store": ": only false (the default: nothing is stored for retrieval) is accepted"}.get(param, "")
        assert error["message"] == f"'{param}' is not supported by this server{accepted}", error["message"]
        assert error["param"] == param
    if name.startswith("prompt plus max_"):  # the message and param name the field the call set
        field = name.split()[2]
        assert "1000000" in error["message"] and "4096" in error["message"] and f" {field} is " in error["message"]
        assert error["param"] == field
    if name == "content a number":  # both shapes content may take are named, not the last one tried
        assert error["message"] == "Input should be a valid string or a valid list at 'messages.0.content'"
        assert error["param"] == "messages.0.content"
    if name == "a refusal part in a user message":
        assert error["message"] == "a user message cannot carry a refusal (only assistant messages do)", error
    if name == "a prompt alone over the context":  # no max_tokens was sent: the message names none
        assert "the prompt alone has" in error["message"] and "max_tokens" not in error["message"], error["message"]
        assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")
    if name == "min_tokens over max_completion_tokens":
        assert "must be at most max_completion_tokens (2)" in error["message"], error["message"]


def test_values_of_unsupported_parameters_that_ask_for_nothing_are_accepted(server: ServerProcess) -> None:
    harmless = _chat(function_call="none", functions=[], prediction=None, best_of=1, modalities=["text"],
                     store=False, web_search_options=None, max_tokens=2)
    assert httpx.post(f"{server.url}/v1/chat/completions", json=harmless, timeout=30).status_code == 200
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "echo": False, "suffix": "", "best_of": 1}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200


def test_an_unknown_url_is_a_404_naming_what_is_served(server: ServerProcess) -> None:
    """OpenAI's "Invalid URL" 404 for a route this server does not have (the Responses API, a typo), listing
    the ``/v1`` routes it does serve, instead of a bare "Not Found"."""
    for method, path in (("POST", "/v1/responses"), ("GET", "/v1/chat/completion")):
        r = httpx.request(method, f"{server.url}{path}", json={"input": "hi"}, timeout=30)
        error = r.json()["error"]
        assert r.status_code == 404 and (error["type"], error["code"]) == ("not_found_error", "unknown_url")
        assert error["message"] == (f"Invalid URL ({method} {path}): this server serves /v1/batches, "
                                    "/v1/chat/completions, /v1/completions, /v1/files, /v1/models")


def test_null_for_a_nullable_openai_field_is_its_default(server: ServerProcess) -> None:
    """``null`` for ``n``, ``stream``, ``logprobs``, ``parallel_tool_calls`` (and ``ignore_eos``) answers as
    the field left out: one choice, not streamed, no log-probabilities (OpenAI's spec has them nullable)."""
    nulls = {"n": None, "stream": None, "logprobs": None, "parallel_tool_calls": None, "ignore_eos": None,
             "temperature": 0}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=_chat(**nulls), timeout=30)
    plain = httpx.post(f"{server.url}/v1/chat/completions", json=_chat(temperature=0), timeout=30)
    assert r.status_code == 200, r.text
    assert [c["message"]["content"] for c in r.json()["choices"]] == [plain.json()["choices"][0]["message"]["content"]]
    assert r.json()["choices"][0]["logprobs"] is None
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "n": None, "stream": None, "logprobs": None}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text


def test_an_assistant_refusal_sent_back_is_part_of_the_conversation(server: ServerProcess) -> None:
    """An assistant turn's refusal, as a content part or as OpenAI's message-level ``refusal`` field, is
    rendered as that turn's text: the same prompt as the refusal sent as plain content."""
    def prompt_tokens(assistant: dict[str, Any]) -> int:
        messages = [{"role": "user", "content": "a"}, {"role": "assistant", **assistant}, {"role": "user", "content": "b"}]
        r = httpx.post(f"{server.url}/v1/chat/completions", json=_chat(messages=messages, max_tokens=1), timeout=30)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens"])

    as_text = prompt_tokens({"content": "I will not say that"})
    assert prompt_tokens({"content": [{"type": "refusal", "refusal": "I will not say that"}]}) == as_text
    assert prompt_tokens({"content": None, "refusal": "I will not say that"}) == as_text
    assert prompt_tokens({"content": ""}) < as_text


def test_server_still_serves_after_bad_inputs(server: ServerProcess) -> None:
    for _, body, _ in CASES[:12]:
        if isinstance(body, dict):
            httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    long_prompt = "word " * 2100  # ~4200 tokens: under api.max_request_length, over the 4096 context
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": long_prompt, "max_tokens": 5}, timeout=30)
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    ok = httpx.post(f"{server.url}/v1/chat/completions", timeout=5,
                    json=_chat(messages=_image_msg(data_uri(gradient_image(40, 40))), max_tokens=3))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    stats = httpx.get(f"{server.url}/internal/stats", timeout=10).json()
    assert stats["decode0"]["kv_pages_used"] == 0 and stats["prefill0"]["kv_pages_used"] == 0


@pytest.fixture(scope="module")
def unstarted_app(tiny_llava: Path) -> TestClient:
    """An app whose workers are never started: auth, body limits and 503 without a worker."""
    cfg = load_config(None, {"model": str(tiny_llava), "api.api_key": "sekret", "api.max_body_bytes": 4096})
    ctx = ServerContext(holder=EngineHolder(tiny_llava, cfg), config=cfg, served_model_name="tiny")
    return TestClient(build_app(ctx, start_engine=False))


def test_401_without_the_right_key(unstarted_app: TestClient) -> None:
    r = unstarted_app.post("/v1/chat/completions", json=_chat())
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = unstarted_app.post("/v1/chat/completions", json=_chat(), headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert unstarted_app.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
    # two Authorization headers, even both right, are refused: a proxy reading the other could disagree on the key
    twice = [("Authorization", "Bearer sekret"), ("Authorization", "Bearer sekret")]
    assert unstarted_app.get("/v1/models", headers=twice).status_code == 401
    r = unstarted_app.post("/v1/chat/completions", json=_chat(), headers=[("Authorization", "Bearer wrong"), *twice[:1]])
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_413_for_a_body_over_the_limit(unstarted_app: TestClient) -> None:
    body = _chat(messages=_image_msg(_b64(b"x" * 8000)))
    r = unstarted_app.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_413_for_a_chunked_body_over_the_limit_and_small_chunked_bodies_pass(unstarted_app: TestClient) -> None:
    import json

    def chunks(data: bytes, size: int = 1000):  # type: ignore[no-untyped-def]
        for i in range(0, len(data), size):
            yield data[i : i + size]

    headers = {"Authorization": "Bearer sekret", "content-type": "application/json"}
    big = json.dumps(_chat(messages=_image_msg(_b64(b"x" * 8000)))).encode()
    r = unstarted_app.post("/v1/chat/completions", content=chunks(big), headers=headers)
    assert "content-length" not in r.request.headers
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    small = json.dumps(_chat()).encode()
    r = unstarted_app.post("/v1/chat/completions", content=chunks(small, 10), headers=headers)
    assert r.status_code == 503, r.text  # parsed and validated; no worker in this app


def test_503_when_no_worker_can_take_the_request(unstarted_app: TestClient) -> None:
    r = unstarted_app.post("/v1/chat/completions", json=_chat(), headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    assert r.headers["retry-after"] == "5" and "warming" in r.json()["error"]["message"]  # WARMING_RETRY_S
    health = unstarted_app.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "warming"
    assert health.headers["retry-after"] == "5"  # a load balancer's probe may time its next look too


def test_image_part_conversion_keeps_image_sizes() -> None:
    img = Image.open(io.BytesIO(PNG))
    assert img.size == (32, 32)


def test_each_request_limit_serves_at_it_and_refuses_past_it(server: ServerProcess) -> None:
    """``api.max_stop_strings`` (64), ``api.max_stop_chars`` (8192), ``api.max_messages`` (2048),
    ``api.max_content_parts`` (4096), ``api.max_n`` (16), ``api.max_logprobs`` (20, chat and completions) and
    the text ``api.max_request_length`` can hold (8192 x 32 characters) at their defaults: a call at each
    limit is served, one past it is a 400 naming the limit, its param and its code."""
    def post(body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
        return httpx.post(f"{server.url}{path}", json=body, timeout=120)

    completion = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0}
    r = post({**completion, "logprobs": 20}, "/v1/completions")
    top = r.json()["choices"][0]["logprobs"]["top_logprobs"][0]  # keyed by text: tokens that decode alike merge
    assert r.status_code == 200 and 15 <= len(top) <= 20, r.text[:300]
    r = post({**completion, "logprobs": 21}, "/v1/completions")
    error = r.json()["error"]
    assert r.status_code == 400 and (error["param"], error["code"]) == ("logprobs", "logprobs_limit")
    assert "api.max_logprobs" in error["message"]
    r = post({**completion, "prompt": "a" * (8192 * 32 + 1)}, "/v1/completions")
    error = r.json()["error"]
    assert r.status_code == 400 and (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert "api.max_request_length" in error["message"]

    long_stop = ["q" * 4096, "z" * 4096]  # 8192 characters that never occur
    at_limit = [
        _chat(stop=[f"never-{i}" for i in range(64)]),
        _chat(stop=long_stop),
        _chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}] * 1023
              + [{"role": "user", "content": "hi"}, {"role": "user", "content": "ok"}], max_tokens=1),
        _chat(messages=[{"role": "user", "content": [{"type": "text", "text": ""}] * 4095 + [{"type": "text", "text": "hi"}]}],
              max_tokens=1),
        _chat(n=16, temperature=1.0, max_tokens=2),
        _chat(logprobs=True, top_logprobs=20, max_tokens=2),
    ]
    past = [
        (_chat(stop=[f"never-{i}" for i in range(65)]), "stop", "stop_limit", "api.max_stop_strings"),
        (_chat(stop=[*long_stop, "!"]), "stop", "stop_limit", "api.max_stop_chars"),
        (_chat(messages=[{"role": "user", "content": "hi"}] * 2049), "messages", "messages_limit", "api.max_messages"),
        (_chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 4097}]), "messages",
         "content_parts_limit", "api.max_content_parts"),
        (_chat(n=17), "n", "n_limit", "api.max_n"),
        (_chat(logprobs=True, top_logprobs=21), "top_logprobs", "logprobs_limit", "api.max_logprobs"),
        (_chat(messages=[{"role": "user", "content": "a" * (8192 * 32 + 1)}]), "messages", "context_length_exceeded",
         "api.max_request_length"),
    ]
    for i, body in enumerate(at_limit):
        r = post(body)
        if i == 2:  # 2,048 messages pass their limit; their ~21,000 tokens then meet api.max_request_length's
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
        else:
            assert r.status_code == 200, r.text[:300]
        if i == 4:
            assert len(r.json()["choices"]) == 16
        if i == 5:
            assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20
    for body, param, code, key in past:
        r = post(body)
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert (error["param"], error["code"]) == (param, code) and key in error["message"], error


@pytest.mark.parametrize(("body", "message"), [
    (_chat(functions=[{"name": "f", "parameters": {}}]), "'functions' is not supported by this server"),
    (_chat(store=True), "'store' is not supported by this server: only false"),
    (_chat(modalities=["audio"]), "'modalities' is not supported by this server: only [\"text\"]"),
    (_chat(top_logprobs=2), "top_logprobs"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 2, "suffix": "end"}, "'suffix' is not supported by this server"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 2, "best_of": 2}, "'best_of' is not supported by this server"),
])
def test_a_whole_request_refusal_validated_outside_http_is_the_same_400(body: dict[str, Any], message: str) -> None:
    """A batch row or a caption job validates its body with ``model_validate`` (no FastAPI "body" prefix on the
    errors' locations): a refusal of the whole request is still its 400, not an IndexError."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from mm_serve.protocol.errors import validation_error
    from mm_serve.protocol.schemas import ChatCompletionRequest, CompletionRequest

    kind = CompletionRequest if "prompt" in body else ChatCompletionRequest
    with pytest.raises(ValidationError) as caught:
        kind.model_validate(body)
    error = validation_error(RequestValidationError(caught.value.errors()))
    assert error.status == 400 and error.type == "invalid_request_error"
    assert error.message.startswith(message) if message.startswith("'") else message in error.message, error.message
