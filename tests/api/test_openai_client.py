"""End-to-end through a real server process with the official ``openai`` client."""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from mm_serve import LLM, SamplingParams
from tests.api.server_process import ServerProcess, data_uri, requests_counted, scrape_metrics
from tests.factories import gradient_image


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(tiny_llava: Path) -> LLM:
    return LLM(model=tiny_llava, mode="colocated")


def _image_message(text: str, *images: str) -> list[dict]:
    parts: list[dict] = [{"type": "image_url", "image_url": {"url": u}} for u in images]
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


def _offline_chat(offline: LLM, text: str, images: list, max_tokens: int) -> str:
    content = [{"type": "image", "image": img} for img in images] + [{"type": "text", "text": text}]
    out = offline.generate({"messages": [{"role": "user", "content": content}]},
                           SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return out[0].text


def test_health_reported_warming_then_ok(server: ServerProcess) -> None:
    seen = server.health_seen  # type: ignore[attr-defined]
    assert seen[-1]["status_code"] == 200 and seen[-1]["status"] == "ok"
    assert set(seen[-1]["workers"]) == {"prefill0", "decode0"}
    assert all(v == "ready" for v in seen[-1]["workers"].values())
    warming = [s for s in seen if s["status_code"] == 503]
    assert all(s["status"] == "warming" for s in warming)
    head = httpx.head(f"{server.url}/health", timeout=10)  # a load balancer's probe
    assert head.status_code == 200 and head.content == b""


def test_raw_bodies_validate_as_the_openai_sdk_types(server: ServerProcess) -> None:
    """Each body and stream chunk, as sent, validates as the official SDK's response types (which check the
    values of ``finish_reason``, ``object`` and ``service_tier``); ``service_tier`` is OpenAI's name of the tier
    served."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    url = f"{server.url}/v1"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    for sent, named in ((None, "default"), ("flex", "flex"), ("priority", "priority"), ("batch", "flex"),
                        ("interactive", "priority"), ("auto", "default")):
        tier = {} if sent is None else {"service_tier": sent}
        assert ChatCompletion.model_validate(httpx.post(f"{url}/chat/completions", json={**chat, **tier},
                                                        timeout=60).json()).service_tier == named
    with httpx.stream("POST", f"{url}/chat/completions", timeout=60, json={
            **chat, "stream": True, "service_tier": "flex", "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= 3 and all(ChatCompletionChunk.model_validate(c).service_tier == "flex" for c in chunks)
    completion = httpx.post(f"{url}/completions", timeout=60,
                            json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "logprobs": 2}).json()
    assert Completion.model_validate(completion).choices[0].finish_reason == "length"


def test_every_answer_carries_a_request_id(client: openai.OpenAI, server: ServerProcess) -> None:
    """``x-request-id`` on every answer, as OpenAI sends it (the SDK's ``_request_id``): a fresh ``req_`` id, or
    the client's own ``X-Request-Id`` echoed (vLLM's rule); a 400 carries one too."""
    chat: Any = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    first, second = (client.chat.completions.with_raw_response.create(**chat) for _ in range(2))
    ids = [r.headers["x-request-id"] for r in (first, second)]
    assert all(re.fullmatch(r"req_[0-9a-f]{32}", i) for i in ids) and ids[0] != ids[1]
    assert first.parse()._request_id == ids[0]
    echoed = client.chat.completions.with_raw_response.create(**chat, extra_headers={"X-Request-Id": "trace-7/a"})
    assert echoed.headers["x-request-id"] == "trace-7/a"
    refused = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "n": 0}, timeout=30,
                         headers={"X-Request-Id": "bad id with spaces"})
    assert refused.status_code == 400 and re.fullmatch(r"req_[0-9a-f]{32}", refused.headers["x-request-id"])


def test_banner_with_working_curl_example(server: ServerProcess, tmp_path: Path) -> None:
    """The banner's "Try it" lines, run as a shell would (drawing scene.png, then the curl), get a
    200 chat completion about the image."""
    text = server.output()
    assert f"mm-serve is ready at {server.url}" in text and f"Playground: {server.url}/playground" in text
    lines = text.split("Try it:\n", 1)[1].split("\nHealth:", 1)[0].splitlines()
    commands = "\n".join(lines).replace("\\\n", " ")
    draw, curl = [c.strip() for c in commands.splitlines()]
    python, rest = draw.split(" ", 1)
    draw = f"{Path.cwd() / python if not Path(python).is_absolute() else python} {rest}"  # the server's cwd
    assert "image_url" in curl and "scene.png" in draw
    out = subprocess.run(["bash", "-c", f"{draw} && {curl}"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout.strip().splitlines()[-1])  # after the drawn scene's caption
    assert answer["choices"][0]["finish_reason"] in ("stop", "length") and answer["usage"]["prompt_tokens"] > 16


def test_models_version_openapi(client: openai.OpenAI, server: ServerProcess) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-nonexistent")
    assert httpx.get(f"{server.url}/version").json()["model"] == "tiny"
    spec = httpx.get(f"{server.url}/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/version"} <= set(spec["paths"])
    schema = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert schema["$ref"].endswith("ChatCompletionRequest")


def test_the_bench_fits_its_prompts_to_the_context_the_server_lists(server: ServerProcess, tiny_llava: Path) -> None:
    """``mm-serve bench --server URL`` without ``--model`` reads the context length from ``/v1/models``
    (``max_model_len``): a chatbot workload against a 512-token model sent 747-token prompts, all 400s."""
    from mm_serve.bench.session import served_context
    from mm_serve.models.registry import load_model_config

    context = load_model_config(tiny_llava).text.max_position_embeddings
    assert served_context(server.url) == context


def test_one_and_two_images_match_offline(client: openai.OpenAI, offline: LLM) -> None:
    a, b = gradient_image(80, 60, 1), gradient_image(40, 90, 2)
    r = client.chat.completions.create(model="tiny", messages=_image_message("What is this?", data_uri(a)),
                                       max_tokens=12, temperature=0)
    assert r.choices[0].message.content == _offline_chat(offline, "What is this?", [a], 12)
    assert r.usage.prompt_tokens == offline.inputs.process(
        {"messages": [{"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "What is this?"}]}]}
    ).prompt_token_ids.__len__()
    r2 = client.chat.completions.create(
        model="tiny", messages=_image_message("Compare.", data_uri(a, "JPEG"), data_uri(b, "WEBP")),
        max_tokens=10, temperature=0,
    )
    assert r2.usage.prompt_tokens >= 2 * 16
    assert r2.usage.total_tokens == r2.usage.prompt_tokens + r2.usage.completion_tokens


def test_file_url_under_allowed_folder(client: openai.OpenAI, media_dir: Path, offline: LLM) -> None:
    img = gradient_image(64, 48, 7)
    path = media_dir / "scene.png"
    img.save(path)
    r = client.chat.completions.create(model="tiny", messages=_image_message("Describe.", path.as_uri()),
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.content == _offline_chat(offline, "Describe.", [img], 8)


def test_text_chat_and_completions_equal_offline(client: openai.OpenAI, offline: LLM) -> None:
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello there"}],
                                       max_tokens=16, temperature=0)
    expected = offline.generate({"messages": [{"role": "user", "content": "Hello there"}]},
                                SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert r.choices[0].message.content == expected.text
    assert r.usage.completion_tokens == len(expected.token_ids)
    c = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=16, temperature=0)
    exp = offline.generate({"prompt": "The quick brown fox"}, SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert c.choices[0].text == exp.text and c.usage.completion_tokens == len(exp.token_ids)


def test_logit_adjustments_equal_offline_streamed_and_not(client: openai.OpenAI, offline: LLM) -> None:
    """logit_bias, presence / frequency penalties (OpenAI's fields) and repetition_penalty, min_tokens (vLLM's,
    through ``extra_body``) give the offline engine's tokens, streamed and not; min_tokens holds off a stop
    token that the bias makes the most likely one."""
    kwargs = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0,
              "logit_bias": {"9": 2.5, "17": 5.0}, "presence_penalty": 0.5, "frequency_penalty": 0.3,
              "extra_body": {"repetition_penalty": 1.2, "min_tokens": 6, "stop_token_ids": [17]}}
    full = client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    exp = offline.generate({"prompt": "The quick brown fox"}, SamplingParams(
        max_tokens=24, temperature=0.0, logit_bias=((9, 2.5), (17, 5.0)), presence_penalty=0.5, frequency_penalty=0.3,
        repetition_penalty=1.2, min_tokens=6, stop_token_ids=(17,)))[0]
    assert full.choices[0].text == streamed == exp.text and full.usage.completion_tokens == len(exp.token_ids)
    assert 6 < len(exp.token_ids) < 24 and exp.token_ids[-1] == 17 and 17 not in exp.token_ids[:6]
    assert full.choices[0].finish_reason == "stop"


def test_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    kwargs = {"model": "tiny", "messages": _image_message("Tell me.", data_uri(gradient_image(50, 50, 3))),
              "max_tokens": 40, "temperature": 0}
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full  # (a random model emits invalid byte runs; both sides decode them alike)
    assert sum(1 for c in chunks for ch in c.choices if ch.finish_reason) == 1


def test_n2_seed_and_max_tokens_1(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Pick a word"}]
    a = client.chat.completions.create(model="tiny", messages=msgs, n=2, seed=11, temperature=1.0, max_tokens=12)
    b = client.chat.completions.create(model="tiny", messages=msgs, n=2, seed=11, temperature=1.0, max_tokens=12)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert 2 <= a.usage.completion_tokens <= 24  # both choices counted, the prompt once
    assert a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens
    one = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, temperature=0)
    assert one.usage.completion_tokens == 1 and one.choices[0].finish_reason in ("length", "stop")
    assert one.usage.total_tokens == one.usage.prompt_tokens + 1


def _spanning_stop(offline: LLM, prompt: str) -> tuple[str, str]:
    """A stop string that spans a token boundary of the greedy output, and the text before it."""
    out = offline.generate({"prompt": prompt}, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    tok = offline.tokenizer
    full = out.text
    for k in range(2, len(out.token_ids) - 2):
        b = len(tok.decode(out.token_ids[:k], skip_special_tokens=True))
        stop = full[b - 2 : b + 2]
        if len(stop) == 4 and full.find(stop) == b - 2 and "\ufffd" not in stop:
            return stop, full[: b - 2]
    pytest.skip("no clean token boundary in this output")


def test_stop_string_spanning_tokens_streamed_and_not(client: openai.OpenAI, offline: LLM) -> None:
    prompt = "Once upon a time"
    stop, expected = _spanning_stop(offline, prompt)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=stop,
                                         stream=True, extra_body={"ignore_eos": True})
    pieces = [c.choices[0].text for c in streamed if c.choices]
    assert "".join(pieces) == expected
    for i in range(len(pieces)):
        assert stop not in "".join(pieces[: i + 1])


def test_include_usage_only_in_final_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert [c.usage is not None for c in chunks].count(True) == 1
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    generated = sum(1 for c in chunks[:-1] for ch in c.choices if ch.delta.content is not None)
    assert last.usage.completion_tokens >= 1 and generated >= 1
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


def test_sse_framing_ends_with_one_done(server: ServerProcess) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    assert all(ln.startswith("data: ") for ln in lines)


def test_logprobs_are_finite(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob


def test_32_concurrent_streams_mixed(server: ServerProcess) -> None:
    def one(i: int) -> tuple[int, list[str]]:
        content: object = f"Stream number {i}"
        if i % 2:
            content = _image_message(f"Stream {i}", data_uri(gradient_image(30 + i, 30, i)))[0]["content"]
        # the batch tier is never refused for latency: on a slow machine 32 calls at once can exceed the
        # standard tier's predicted TTFT and get a (correct) 429; this test is about the streams' format
        body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8 + i % 5,
                "stream": True, "temperature": 0, "service_tier": "batch"}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as r:
            return r.status_code, [ln for ln in r.iter_lines() if ln]

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    for status, lines in results:
        assert status == 200, lines
        assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
        choices = [json.loads(ln[6:])["choices"][0] for ln in lines[:-1]]
        assert sum(1 for c in choices if c["finish_reason"]) == 1
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert all(set(c["delta"]) == {"content"} and c["delta"]["content"] for c in choices[1:-1])
        assert choices[-1]["finish_reason"] and set(choices[-1]["delta"]) <= {"content"}  # {} when no new text, as OpenAI


def test_disconnect_mid_stream_frees_pages(server: ServerProcess) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Talk for a long time"}],
            "max_tokens": 3000, "stream": True, "extra": 1, "ignore_eos": True}
    before = scrape_metrics(server.url)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 5:
                break
    stats: dict = {}
    for _ in range(100):
        stats = httpx.get(f"{server.url}/internal/stats", timeout=10).json()
        if all(s["kv_pages_used"] == 0 and s["running"] == 0 for s in stats.values()):
            break
        time.sleep(0.1)
    assert all(s["kv_pages_used"] == 0 for s in stats.values()), stats
    assert all(s["pages_integrity_ok"] for s in stats.values())
    after = scrape_metrics(server.url)
    assert requests_counted(before, after) == {("abort", "499"): 1}
    e2e = ("mm_serve_e2e_request_latency_seconds_count", ())
    assert after[e2e] == before.get(e2e, 0.0)  # a request cut short has no whole answer to time


def test_disconnect_of_a_non_streaming_request_aborts_it(server: ServerProcess) -> None:
    """Tokens arriving all the time must not hide the disconnect (the check runs on a clock)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Talk for a long time"}],
            "max_tokens": 4000, "n": 16, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=1.0)
    gone = time.monotonic()
    stats: dict = {}
    while time.monotonic() - gone < 3.0:  # the whole generation would take far longer
        stats = httpx.get(f"{server.url}/internal/stats", timeout=10).json()
        if all(s["kv_pages_used"] == 0 and s["running"] == 0 for s in stats.values()):
            break
        time.sleep(0.1)
    assert all(s["kv_pages_used"] == 0 and s["running"] == 0 for s in stats.values()), stats


def test_streamed_logprobs_equal_the_non_streamed_ones(client: openai.OpenAI) -> None:
    """A stream's chunks carry the log-probabilities of every token, in order, once: joined they equal
    the non-streamed answer's (completions: tokens, values, top entries and text offsets; chat: content)."""
    done = client.completions.create(model="tiny", prompt="a purple", max_tokens=6, temperature=0, logprobs=2)
    chunks = list(client.completions.create(model="tiny", prompt="a purple", max_tokens=6, temperature=0, logprobs=2,
                                            stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs is not None]
    whole = done.choices[0].logprobs
    assert whole is not None and len(whole.tokens) == done.usage.completion_tokens == 6
    assert [t for p in parts for t in p.tokens] == whole.tokens
    assert [v for p in parts for v in p.token_logprobs] == whole.token_logprobs
    assert [v for p in parts for v in p.top_logprobs] == whole.top_logprobs
    assert [v for p in parts for v in p.text_offset] == whole.text_offset
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    streamed = [c for c in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                                          stream=True)]
    content = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in content] == [(e.token, e.logprob) for e in chat.choices[0].logprobs.content]


def test_echo_returns_the_prompt_and_its_logprobs_as_transformers_computes_them(
        client: openai.OpenAI, tiny_llava: Path) -> None:
    """``echo`` with ``logprobs``: the text is the prompt's then the completion's; the prompt's tokens come
    first, the first with null log-probability, the rest equal transformers' log-softmax of the logits
    before each (to 1e-4), with the best alternatives; twice (the second time its pages are cached, and
    the prefill still computes every position), streamed and not, disaggregated."""
    import torch

    from tests.golden import load_reference

    prompt = "a purple square and a small green circle on the left"
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    for stream in (False, False, True):
        if stream:
            chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                                    logprobs=2, echo=True, stream=True))
            parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            tokens = [t for p in parts for t in p.tokens]
            values = [v for p in parts for v in p.token_logprobs]
            tops = [v for p in parts for v in p.top_logprobs]
            offsets = [v for p in parts for v in p.text_offset]
        else:
            done = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=2,
                                             echo=True)
            text, lp = done.choices[0].text, done.choices[0].logprobs
            tokens, values, tops, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
            assert done.usage.prompt_tokens_details.cached_tokens == 0  # every position computed
        assert text == prompt + plain.choices[0].text
        assert tokens[-4:] == plain.choices[0].logprobs.tokens and values[-4:] == plain.choices[0].logprobs.token_logprobs
        assert offsets[-4:] == [len(prompt) + o for o in plain.choices[0].logprobs.text_offset]
        n_prompt = len(tokens) - 4
        assert values[0] is None and tops[0] is None and all(len(t) >= 1 for t in tops[1:n_prompt]), tops
        for token, offset in zip(tokens[:n_prompt], offsets[:n_prompt], strict=True):  # each where the text holds it
            assert text[offset:].startswith((token, token.lstrip())) or token == "<s>", (token, offset, text)
    ids = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                    logprobs=0).choices[0].logprobs
    reference = load_reference(tiny_llava, multimodal=True)
    from mm_serve.inputs.input_processor import InputProcessor
    from mm_serve.models.registry import load_model_config

    prompt_ids = InputProcessor(tiny_llava, load_model_config(tiny_llava)).tokenizer(prompt)["input_ids"]
    assert len(prompt_ids) == n_prompt
    with torch.inference_mode():
        logp = torch.log_softmax(reference(input_ids=torch.tensor([prompt_ids])).logits[0].float(), dim=-1)
    expected = [float(logp[p - 1, prompt_ids[p]]) for p in range(1, len(prompt_ids))]
    assert values[1:n_prompt] == pytest.approx(expected, abs=1e-4)
    assert ids.token_logprobs[1:n_prompt] == pytest.approx(expected, abs=1e-4)


def test_echo_without_logprobs_prepends_the_prompt_to_every_choice(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt=["one two", "three"], max_tokens=3, temperature=0, echo=True,
                                  n=2)
    plain = client.completions.create(model="tiny", prompt=["one two", "three"], max_tokens=3, temperature=0, n=2)
    assert [c.text for c in r.choices] == [p + c.text for p, c in zip(["one two"] * 2 + ["three"] * 2, plain.choices, strict=True)]
    assert r.usage.completion_tokens == plain.usage.completion_tokens


def test_streamed_logprobs_cover_every_token_under_load(server: ServerProcess) -> None:
    """Tokens arrive on the receiver thread while a chunk's log-probabilities are formatted: each chunk's
    text, tokens and log-probabilities are read together, so every token's entry is sent exactly once, also
    when tokens come in between."""
    def one(path: str, seed: int) -> list[int]:
        chat = path.endswith("chat/completions")
        body: dict[str, Any] = {"model": "tiny", "max_tokens": 150, "ignore_eos": True, "n": 3, "temperature": 1.3,
                                "seed": seed, "stream": True}
        if chat:
            body.update(messages=[{"role": "user", "content": "How many shapes?"}], logprobs=True, top_logprobs=20)
        else:
            body.update(prompt="How many shapes?", logprobs=20)
        counts = [0, 0, 0]
        with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        entries = c.get("logprobs") or {}
                        counts[c["index"]] += len(entries.get("content") or entries.get("tokens") or [])
        return counts

    paths = ["/v1/chat/completions", "/v1/completions"] * 3
    with concurrent.futures.ThreadPoolExecutor(len(paths)) as pool:
        results = list(pool.map(one, paths, range(len(paths))))
    assert results == [[150, 150, 150]] * len(paths)
