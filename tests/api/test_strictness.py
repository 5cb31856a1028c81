"""Where OpenAI and vLLM answer 400, so do we: status, error type and the parameter named, then a
normal request is answered. Also: streamed chunks after the first carry no ``role``, typed
``<image>`` text is text, images only in user messages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.server_process import ServerProcess, data_uri
from tests.factories import gradient_image

IMAGE = {"type": "image_url", "image_url": {"url": data_uri(gradient_image(40, 30))}}


def _chat(**overrides: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **overrides}


def _completion(**overrides: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 4, **overrides}


# (name, path, body (dict or raw JSON bytes), status, error type, param)
CASES: list[tuple[str, str, Any, int, str, str | None]] = [
    ("top_logprobs without logprobs", "chat", _chat(top_logprobs=2), 400, "invalid_request_error", "top_logprobs"),
    ("top_logprobs with logprobs false", "chat", _chat(top_logprobs=0, logprobs=False), 400,
     "invalid_request_error", "top_logprobs"),
    ("stream_options without stream", "chat", _chat(stream_options={"include_usage": True}), 400,
     "invalid_request_error", "stream_options"),
    ("stream_options with stream false", "completions", _completion(stream=False, stream_options={}), 400,
     "invalid_request_error", "stream_options"),
    ("user content null", "chat", _chat(messages=[{"role": "user", "content": None}]), 400,
     "invalid_request_error", "messages"),
    ("system content null", "chat", _chat(messages=[{"role": "system", "content": None},
                                                    {"role": "user", "content": "hi"}]), 400,
     "invalid_request_error", "messages"),
    ("stop_token_ids beyond the vocabulary", "chat", _chat(stop_token_ids=[10**6]), 400,
     "invalid_request_error", "stop_token_ids"),
    ("stop_token_ids negative", "completions", _completion(stop_token_ids=[-7]), 400,
     "invalid_request_error", "stop_token_ids"),
    ("stop_token_ids not integers", "chat", _chat(stop_token_ids=["a"]), 400, "invalid_request_error",
     "stop_token_ids.0"),
    ("lone surrogate in stop", "chat",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stop": "\\ud800"}',
     400, "invalid_request_error", "stop"),
    ("lone surrogate in a stop list", "completions",
     b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, "stop": ["ok", "a\\udc00"]}',
     400, "invalid_request_error", "stop"),
    ("booleans as prompt token ids", "completions", _completion(prompt=[True, False]), 400, "invalid_request_error",
     "prompt.0"),
    ("seed above signed 64-bit", "chat", _chat(seed=2**63), 400, "invalid_request_error", "seed"),
    ("seed below signed 64-bit", "chat", _chat(seed=-(2**63) - 1), 400, "invalid_request_error", "seed"),
    ("prompt filling the context, no max_tokens", "chat",
     _chat(max_tokens=None, messages=[{"role": "user", "content": "circle " * 5000}]), 400,
     "invalid_request_error", "messages"),  # the prompt alone: no max_tokens was sent to name
    ("image in a system message", "chat", _chat(messages=[{"role": "system", "content": [IMAGE]},
                                                          {"role": "user", "content": "hi"}]), 400,
     "invalid_request_error", "messages"),
    ("image in an assistant message", "chat", _chat(messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [IMAGE]},
        {"role": "user", "content": "and?"}]), 400, "invalid_request_error", "messages"),
]


def _post(server: ServerProcess, path: str, body: Any) -> httpx.Response:
    url = server.url + ("/v1/chat/completions" if path == "chat" else "/v1/completions")
    if isinstance(body, bytes):
        return httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    return httpx.post(url, json=body, timeout=30)


@pytest.mark.parametrize("name,path,body,status,kind,param", CASES, ids=[c[0] for c in CASES])
def test_strict_like_openai(server: ServerProcess, name: str, path: str, body: Any, status: int, kind: str,
                            param: str | None) -> None:
    """Each case: the status, OpenAI's error type, the parameter named; the server answers after it."""
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == (kind, param), error
    assert error["message"]
    assert _post(server, "chat", _chat()).status_code == 200


def test_image_only_in_user_messages_message(server: ServerProcess) -> None:
    """The refusal says where images are accepted."""
    r = _post(server, "chat", CASES[-1][2])
    assert "images are accepted only in user messages" in r.json()["error"]["message"]


def test_image_outside_user_messages_is_refused_before_any_fetch(server: ServerProcess) -> None:
    """An image URL that could not be fetched (a file:// outside the allowed directory) in a system
    message gets the role refusal, not the fetch error: the roles are checked before fetching."""
    unfetchable = {"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}
    r = _post(server, "chat", _chat(messages=[{"role": "system", "content": [unfetchable]},
                                              {"role": "user", "content": "hi"}]))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages" and error["code"] is None, error
    assert error["message"] == "images are accepted only in user messages; message 0 (role 'system') has an image part"


def test_generate_help_names_the_default_question(capsys: pytest.CaptureFixture[str]) -> None:
    """``mm-serve generate`` without --prompt asks its own question; --help says which."""
    from mm_serve.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0
    assert "default: 'Describe the image.'" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 2**63 - 1])
def test_any_signed_64_bit_seed_is_accepted_and_reproducible(server: ServerProcess, seed: int) -> None:
    """The full signed 64-bit range works, n > 1 included, and a seed gives the same tokens twice."""
    body = _chat(seed=seed, temperature=1.0, n=2, max_tokens=6)
    first, second = _post(server, "chat", body), _post(server, "chat", body)
    assert first.status_code == 200, first.text
    texts = [c["message"]["content"] for c in first.json()["choices"]]
    assert texts == [c["message"]["content"] for c in second.json()["choices"]]


def test_stop_token_ids_in_range_stop_the_output(server: ServerProcess, tiny_llava: Path) -> None:
    """Valid stop_token_ids end the output: with every id of the vocabulary listed, at the first token
    (kept in the text, as vLLM keeps non-special stop tokens)."""
    vocab = json.loads((tiny_llava / "config.json").read_text())["text_config"]["vocab_size"]
    body = _completion(max_tokens=5, temperature=0, stop_token_ids=list(range(vocab)))
    answer = _post(server, "completions", body).json()
    assert answer["choices"][0]["finish_reason"] == "stop" and answer["usage"]["completion_tokens"] == 1
    assert _post(server, "completions", {**body, "stop_token_ids": [vocab - 1]}).status_code == 200


def test_streamed_chunks_after_the_first_omit_role(server: ServerProcess) -> None:
    """Only each choice's first delta has ``role``; later deltas have no ``role`` key at all."""
    body = _chat(stream=True, max_tokens=6, temperature=0, n=2)
    deltas: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    deltas[choice["index"]].append(choice["delta"])
    for index in (0, 1):
        assert deltas[index][0]["role"] == "assistant"
        assert len(deltas[index]) > 1 and all("role" not in d for d in deltas[index][1:])


def test_typed_image_token_is_text(server: ServerProcess) -> None:
    """A user may write ``<image>`` with no image: it is text, not a placeholder."""
    r = _post(server, "chat", _chat(messages=[{"role": "user", "content": "What does <image> mean?"}]))
    assert r.status_code == 200, r.text
    plain = _post(server, "chat", _chat(messages=[{"role": "user", "content": "What does mean?"}]))
    assert r.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"]


def test_docs_work_offline(server: ServerProcess) -> None:
    """/docs loads Swagger UI from this server (fastapi-offline's assets), not from a CDN."""
    html = httpx.get(f"{server.url}/docs", timeout=10).text
    assets = [part.split('"')[0] for part in html.split('src="')[1:] + html.split('href="')[1:]]
    local = [a for a in assets if a.endswith((".js", ".css"))]
    assert local and all(a.startswith("/") for a in local), assets
    assert all(httpx.get(f"{server.url}{a}", timeout=10).status_code == 200 for a in local)


@pytest.mark.parametrize("extra", [[], ["--server", "http://127.0.0.1:9"]], ids=["own server", "--server"])
def test_bench_takes_a_registered_model_name(extra: list[str]) -> None:
    """``mm-serve bench --model embedded`` gets past argument checks and model resolution (no run)."""
    from mm_serve.cli.bench import _check, _model_dir
    from mm_serve.cli.main import build_parser
    from mm_serve.models.named_models import resolve_model

    args = build_parser().parse_args(["bench", "--sweep", "--model", "embedded", *extra])
    _check(args)
    assert _model_dir(args)[0] == resolve_model("embedded")
