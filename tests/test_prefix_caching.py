"""Prefix caching and the encoder cache on the real engine: outputs equal caching off (and so
transformers, see test_golden_parity), what is shared and what never is, tiny pools."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from mm_serve import LLM, SamplingParams
from tests.factories import gradient_image
from tests.test_golden_parity import LLAVA_CASES

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
Q = "USER: <image>\nWhat is in this picture? ASSISTANT:"
SYSTEM = " ".join(["You are a careful assistant who answers questions about pictures."] * 4)


@pytest.fixture(scope="module")
def cached(tiny_llava: Path) -> LLM:
    return LLM(model=tiny_llava, mode="colocated", num_pages=256, page_size=16)


@pytest.fixture(scope="module")
def uncached(tiny_llava: Path) -> LLM:
    return LLM(model=tiny_llava, mode="colocated", num_pages=256, page_size=16, enable_prefix_caching=False,
               encoder_cache_bytes=0)


def _tokens(llm: LLM, requests: list[dict[str, Any]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(requests, GREEDY)]


def _image_bytes(image: Image.Image, fmt: str, **save: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)
    return buf.getvalue()


def test_golden_cases_from_a_warm_cache_equal_caching_off(cached: LLM, uncached: LLM) -> None:
    requests = [r for _, r in LLAVA_CASES]
    expected = _tokens(uncached, requests)
    assert _tokens(cached, requests) == expected  # cold: fills the caches
    hits_before = cached.engine.encoder_cache.hits  # type: ignore[union-attr]
    warm = cached.generate(requests, GREEDY)
    assert [o.token_ids for o in warm] == expected
    long_text = next(o for (name, _), o in zip(LLAVA_CASES, warm, strict=True) if name == "long-text-~300-tokens")
    assert long_text.num_cached_tokens == (long_text.num_prompt_tokens - 1) // 16 * 16  # every full page but the last token's
    assert all(0 <= o.num_cached_tokens < o.num_prompt_tokens for o in warm)
    assert cached.engine.encoder_cache.hits - hits_before == sum(  # type: ignore[union-attr]
        len(r.get("images", [])) + (1 if "messages" in r else 0) for r in requests)
    assert uncached.engine.kv_cache.pool.num_cached == 0
    cached.engine.kv_cache.pool.check_integrity()


def test_a_conversation_reuses_each_earlier_turn(cached: LLM, uncached: LLM) -> None:
    image = gradient_image(72, 56, 21)
    prompt = SYSTEM + " USER: <image>\nWhat is in this picture? ASSISTANT:"
    previous_prompt = 0
    for turn, question in enumerate(("Is it bright?", "Which colour is most common?", "Describe it again.")):
        request = {"prompt": prompt, "images": [image]}
        expected = uncached.generate(request, GREEDY)[0]
        out = cached.generate(request, GREEDY)[0]
        assert out.token_ids == expected.token_ids
        if turn:  # the previous turn's prompt pages are cached
            assert out.num_cached_tokens >= previous_prompt // 16 * 16 - 16
            assert out.num_cached_tokens > 0
        previous_prompt = out.num_prompt_tokens
        prompt += out.text + f" USER: {question} ASSISTANT:"


def test_same_text_with_different_images_never_shares_a_page_with_an_image(cached: LLM, uncached: LLM) -> None:
    prompt = SYSTEM + " USER: <image>\nWhat is in this picture? ASSISTANT:"
    first_image = len(cached.engine.inputs.tokenizer(SYSTEM + " USER:").input_ids)  # tokens before the image
    a, b = gradient_image(64, 64, 31), gradient_image(64, 64, 32)
    out_a = cached.generate({"prompt": prompt, "images": [a]}, GREEDY)[0]
    out_b = cached.generate({"prompt": prompt, "images": [b]}, GREEDY)[0]
    assert out_b.num_cached_tokens <= first_image // 16 * 16  # stops before the page with the image
    assert out_b.num_cached_tokens >= 16  # the system prompt's full pages are shared
    assert out_a.token_ids != out_b.token_ids  # the images differ, so do the answers
    assert out_b.token_ids == uncached.generate({"prompt": prompt, "images": [b]}, GREEDY)[0].token_ids


def test_png_vs_jpeg_pixels_miss_and_same_pixels_hit_both_caches(tiny_llava: Path, uncached: LLM) -> None:
    llm = LLM(model=tiny_llava, mode="colocated", num_pages=256, page_size=16)
    encoder = llm.engine.encoder_cache
    assert encoder is not None
    picture = gradient_image(80, 60, 41)
    png, jpeg = _image_bytes(picture, "PNG"), _image_bytes(picture, "JPEG", quality=70)
    bmp = _image_bytes(picture, "BMP")  # lossless: the same pixels as the PNG
    prompt = SYSTEM + " " + Q

    def ask(data: bytes) -> Any:
        return llm.generate({"prompt": prompt, "images": [data]}, GREEDY)[0]

    first = ask(png)
    assert (encoder.hits, encoder.misses) == (0, 1)
    other = ask(jpeg)
    assert (encoder.hits, encoder.misses) == (0, 2)  # other pixels: encoded again
    image_page = len(llm.engine.inputs.tokenizer(SYSTEM + " USER:").input_ids) // 16 * 16
    assert other.num_cached_tokens <= image_page
    same = ask(bmp)
    assert (encoder.hits, encoder.misses) == (1, 2)  # the same pixels: the tower is skipped
    assert same.num_cached_tokens == (same.num_prompt_tokens - 1) // 16 * 16  # and every full page is reused
    assert same.token_ids == first.token_ids
    for data, out in ((png, first), (jpeg, other)):
        assert out.token_ids == uncached.generate({"prompt": prompt, "images": [data]}, GREEDY)[0].token_ids


def test_preemption_and_eviction_under_a_tiny_pool_keep_outputs(tiny_llava: Path, uncached: LLM) -> None:
    """40 pages of 4 tokens, an encoder cache that holds one image: requests sharing a system
    prompt preempt each other, cached pages are evicted and reused, embeddings are evicted
    while requests still hold theirs; every output equals the large uncached run."""
    config = uncached.engine.model_config
    assert config.vision is not None
    one_image = config.vision.num_image_tokens * config.text.hidden_size * 4  # float32 embeddings, bytes
    llm = LLM(model=tiny_llava, mode="colocated", num_pages=40, page_size=4, max_running=8,
              encoder_cache_bytes=one_image + 1)
    images = [gradient_image(48, 40, 50 + i % 3) for i in range(9)]
    requests = [{"prompt": "A note. " * 3 + Q, "images": [img]} for img in images]
    requests += [{"prompt": "A note. " * 3 + f"Count to {i} please."} for i in range(5)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in uncached.generate(requests, params)]
    outputs = llm.generate(requests, params)
    assert [o.token_ids for o in outputs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_cache.pool.num_evictions > 0
    assert llm.engine.encoder_cache is not None and llm.engine.encoder_cache.evictions > 0
    assert sum(o.num_cached_tokens for o in outputs) > 0
    pool = llm.engine.kv_cache.pool
    pool.check_integrity()
    assert pool.num_free == pool.num_pages
