"""Prefix and encoder caches through the HTTP API (1P1D): usage.prompt_tokens_details.cached_tokens,
/metrics counters and /health's per-worker hit rate."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from mm_serve.inputs.input_processor import InputProcessor
from mm_serve.models.registry import load_model_config
from tests.api.server_process import ServerProcess, data_uri, scrape_metrics
from tests.factories import gradient_image

SYSTEM = "You describe pictures carefully and briefly. " * 8


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _ask(client: openai.OpenAI, image_seed: int, question: str, stream: bool = False,
         salt: str | None = None) -> tuple[str, int, int]:
    """(text, prompt_tokens, cached_tokens) of a greedy chat call with a system prompt and an image (and
    ``cache_salt`` ``salt``)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(gradient_image(56, 48, image_seed))}},
        {"type": "text", "text": question}]}]
    extra = {} if salt is None else {"extra_body": {"cache_salt": salt}}
    if not stream:
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,  # type: ignore[arg-type]
                                           **extra)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        return r.choices[0].message.content or "", r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens or 0
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, **extra))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


def _counter(url: str, name: str) -> float:
    return sum(v for (n, _), v in scrape_metrics(url).items() if n == name)


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_repeated_image_and_prefix_are_reported_as_cached(client: openai.OpenAI, server: ServerProcess) -> None:
    hits_before = _counter(server.url, "mm_serve_encoder_cache_hits_total")
    prefix_hits_before = _counter(server.url, "mm_serve_prefix_cache_hit_tokens_total")
    text, prompt, cached = _ask(client, 501, "What is in this picture?")
    assert cached == 0  # nothing of this image was seen before
    again, prompt2, cached2 = _ask(client, 501, "What is in this picture?")
    assert again == text and prompt2 == prompt
    assert cached2 == (prompt - 1) // 16 * 16  # every full page but the one holding the last token
    streamed, _, cached3 = _ask(client, 501, "What is in this picture?", stream=True)
    assert streamed == text and cached3 == cached2
    assert _wait_for(lambda: _counter(server.url, "mm_serve_encoder_cache_hits_total") >= hits_before + 2)
    assert _wait_for(lambda: _counter(server.url, "mm_serve_prefix_cache_hit_tokens_total")
                     >= prefix_hits_before + 2 * cached2)
    health = httpx.get(f"{server.url}/health", timeout=5).json()
    assert 0 < health["caches"]["prefill0"]["kv_cache_hit_rate"] <= 1
    assert health["caches"]["prefill0"]["encoder_cache_hit_rate"] > 0
    pages, held = health["caches"]["prefill0"]["kv_cached_pages"], health["caches"]["prefill0"]["encoder_cache_bytes"]
    assert type(pages) is int and pages >= cached2 // 16  # counts stay integers in the JSON
    assert type(held) is int and held > 0
    assert "decode0" not in health["caches"]


def test_a_different_image_with_the_same_text_shares_only_the_text_before_it(
    client: openai.OpenAI, tiny_llava: Path,
) -> None:
    inputs = InputProcessor(tiny_llava, load_model_config(tiny_llava)).process({"messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": [
            {"type": "image", "image": gradient_image(56, 48, 502)}, {"type": "text", "text": "Which colour?"}]}]})
    first_image = inputs.prompt_token_ids.index(load_model_config(tiny_llava).vision.image_token_index)  # type: ignore[union-attr]
    _, prompt, _ = _ask(client, 502, "Which colour?")
    _, prompt_b, cached_b = _ask(client, 503, "Which colour?")
    assert prompt_b == prompt == len(inputs.prompt_token_ids)
    assert cached_b == first_image // 16 * 16 > 0  # the system prompt's full pages, none holding the image


def test_a_cache_salt_shares_pages_and_images_only_with_its_own_salt(client: openai.OpenAI,
                                                                     server: ServerProcess) -> None:
    """Tenant A asks about an image; tenant B (another salt) sends the same call: no cached token, its image
    encoded again (the encoder cache missed), the same answer (the system prompt, cached by the unsalted calls
    before, is not shared either); B again, and A again: each hits its own entries; a call without a salt
    shares neither's."""
    misses = _counter(server.url, "mm_serve_encoder_cache_misses_total")
    text, prompt, cached = _ask(client, 504, "What is in this picture?", salt="tenant-a")
    assert cached == 0
    other, _, cached_b = _ask(client, 504, "What is in this picture?", salt="tenant-b")
    assert other == text and cached_b == 0
    assert _wait_for(lambda: _counter(server.url, "mm_serve_encoder_cache_misses_total") >= misses + 2)
    full_pages = (prompt - 1) // 16 * 16
    for salt in ("tenant-b", "tenant-a"):
        again, _, hit = _ask(client, 504, "What is in this picture?", stream=salt == "tenant-a", salt=salt)
        assert again == text and hit == full_pages, salt
    unsalted, _, cached_none = _ask(client, 504, "What is in this picture?")
    assert unsalted == text and cached_none < full_pages  # at most the system prompt of earlier unsalted calls
    assert _wait_for(lambda: _counter(server.url, "mm_serve_encoder_cache_misses_total") >= misses + 3)
