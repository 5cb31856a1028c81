"""Every family through the service's hard paths: prefix caching on against off, a decode pool so small
that requests are preempted and recomputed, a second pass that hits the prefix and encoder caches,
and the decode worker killed mid-stream (the request migrates). The greedy tokens stay those of a
colocated engine without prefix caching, whose own parity with transformers each family's test file
proves (tests/test_model_families.py, test_llava_next.py, test_llava_onevision.py). LLaVA-NeXT's
preemption and kill are in test_llava_next.py; LLaVA-1.5 CLIP's across tests/test_disaggregation.py
and test_fault_tolerance.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mm_serve import LLM, SamplingParams
from tests.factories import build_checkpoint, gradient_image
from tests.test_fault_tolerance import assert_decode_kill_migrates

Q = "USER: <image>\nWhat is in this picture? ASSISTANT:"
Q2 = "USER: <image>\nCompare this <image>\nwith the first one. ASSISTANT:"
REQUESTS: list[dict[str, Any]] = [
    {"prompt": Q, "images": [gradient_image(300, 40, 1)]},  # wide
    {"prompt": Q, "images": [gradient_image(30, 200, 2)]},  # tall
    {"prompt": Q, "images": [gradient_image(200, 190, 3)]},  # large enough to tile (and pool) where a family does
    {"prompt": Q2, "images": [gradient_image(3, 5, 4), gradient_image(80, 60, 5)]},  # tiny beside a small one
]
KILL_TOKENS = 120  # long enough that the kill lands mid-stream on a fast machine too
KINDS = ["llava-siglip", "llava-onevision", "fast-vlm", "qwen2-vl"]


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> tuple[list[list[int]], int]:
    """Greedy tokens (``KILL_TOKENS`` of them) of a colocated engine without prefix caching, and the
    longest request's tokens (prompt and output)."""
    llm = LLM(model=checkpoint, mode="colocated", num_pages=512, page_size=16, enable_prefix_caching=False)
    outputs = llm.generate(REQUESTS, SamplingParams(max_tokens=KILL_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outputs], max(o.num_prompt_tokens for o in outputs) + KILL_TOKENS


def test_preempted_and_cached_requests_keep_their_tokens(checkpoint: Path,
                                                         expected: tuple[list[list[int]], int]) -> None:
    """Disaggregated, prefix caching on, a decode pool of pages for one request and a little: preempted
    requests recompute from their handed-over image rows (no image encoded twice); asked again, the
    images hit the caches. The same tokens every time.

    Each request decodes ``KILL_TOKENS`` tokens, so any two of them decoding at once outgrow the pool,
    and a decode lasts long enough that on a loaded machine the next hand-off still arrives during it
    (with short decodes, requests prefilled far apart each finish before the next, and none is preempted)."""
    tokens, longest = expected
    params = SamplingParams(max_tokens=KILL_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(model=checkpoint, mode="disaggregated", num_pages=-(-longest // 4) + 4, page_size=4) as llm:
        first = llm.generate(REQUESTS, params)
        again = llm.generate(REQUESTS, params)
        assert llm.client is not None
        stats = llm.client.query_stats()
    assert [o.token_ids for o in first] == tokens and [o.token_ids for o in again] == tokens
    assert stats[("decode", 0)].num_preemptions > 0 and stats[("decode", 0)].num_encoded_images == 0
    assert stats[("prefill", 0)].num_encoded_images == 5  # each image once: the second pass hit the cache
    assert sum(o.num_cached_tokens for o in again) > 0


def test_decode_killed_mid_stream_migrates_with_the_same_tokens(checkpoint: Path,
                                                                expected: tuple[list[list[int]], int]) -> None:
    tokens, _ = expected
    assert_decode_kill_migrates(checkpoint, REQUESTS[3],
                                SamplingParams(max_tokens=KILL_TOKENS, temperature=0.0, ignore_eos=True), tokens[3])
