"""The warm-up pass a worker runs before it reports ready leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

from mm_serve import LLM, SamplingParams
from mm_serve.runtime.warm_up import warm_up
from tests.factories import gradient_image

Q = "USER: <image>\nWhat is in this picture? ASSISTANT:"


def _outputs(llm: LLM) -> list[list[int]]:
    requests = [{"prompt": Q, "images": [gradient_image(80, 60, 1)]}, {"prompt": "Serving a language model means"}]
    return [o.token_ids for o in llm.generate(requests, SamplingParams(max_tokens=12, temperature=0.0))]


def test_warm_up_gives_back_its_pages_caches_nothing_and_outputs_are_unchanged(tiny_llava: Path) -> None:
    cold, warmed = LLM(tiny_llava, mode="colocated", enable_prefix_caching=True), LLM(tiny_llava, mode="colocated", enable_prefix_caching=True)
    engine = warmed.engine
    assert engine is not None
    pool = engine.kv_cache.pool
    assert warm_up(engine.runner, engine.max_model_len) is True
    assert (pool.num_used, pool.num_free, pool.num_cached) == (0, pool.num_pages, 0)
    assert engine.model.num_encoded_images == 0  # the tower ran, but no request's image was encoded
    assert _outputs(warmed) == _outputs(cold)


def test_warm_up_fits_its_prompt_to_the_context_and_skips_when_pages_are_short(tiny_llava: Path) -> None:
    llm = LLM(tiny_llava, mode="colocated", num_pages=2, page_size=16)  # context: the pool's 32 tokens
    engine = llm.engine
    assert engine is not None
    pool = engine.kv_cache.pool
    assert engine.max_model_len == 32
    assert warm_up(engine.runner, engine.max_model_len) is True  # 30 prompt tokens + the decode token: 2 pages
    assert pool.num_free == 2
    held = pool.allocate(1)
    assert warm_up(engine.runner, engine.max_model_len) is False  # 1 free page
    assert pool.num_free == 1
    pool.free(held)
    assert warm_up(engine.runner, 2) is False  # no prompt token fits a 2-token context
