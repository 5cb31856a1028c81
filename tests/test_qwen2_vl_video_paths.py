"""Qwen2-VL and Qwen2.5-VL videos through the service's hard paths (Qwen2.5-VL's temporal positions depend
on the sampled frame rate, carried with the request): disaggregated with prefix caching on and off, a decode pool so
small that requests are preempted and recomputed, a second pass that hits the prefix and encoder caches,
a multi-turn video chat whose follow-up reuses the first turn's KV, and the decode worker killed
mid-stream (the request migrates). The greedy tokens stay those of a colocated engine without prefix
caching, whose parity with transformers tests/test_qwen2_vl.py proves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mm_serve import LLM, SamplingParams
from mm_serve.media.video_loading import encode_video
from mm_serve.models.registry import load_model_config
from tests.factories import build_checkpoint, gradient_image, gradient_video
from tests.test_fault_tolerance import assert_decode_kill_migrates

QV = "USER: <video>\nWhat happens in this video? ASSISTANT:"
QIV = "USER: <image>\nHere is a picture, and <video>\na video. What changes? ASSISTANT:"
REQUESTS: list[dict[str, Any]] = [
    {"prompt": QV, "videos": [gradient_video(6, 84, 56, 1)]},
    {"prompt": QV, "videos": [gradient_video(6, 84, 56, 1, fps=1.0)]},  # the same frames at another rate
    {"prompt": QIV, "images": [gradient_image(80, 60, 5)], "videos": [gradient_video(4, 56, 112, 2, fps=3.0)]},
]
TOKENS = 120  # long enough that two decoding at once outgrow the small pool, and that a kill lands mid-stream


def _greedy(n: int = TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen2-vl", "qwen2.5-vl"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> tuple[list[list[int]], int]:
    """Greedy tokens of a colocated engine without prefix caching, and the longest request's tokens."""
    llm = LLM(model=checkpoint, mode="colocated", num_pages=512, page_size=16, enable_prefix_caching=False)
    outputs = llm.generate(REQUESTS, _greedy())
    return [o.token_ids for o in outputs], max(o.num_prompt_tokens for o in outputs) + TOKENS


def test_the_frame_rate_changes_the_tokens_on_qwen2_5_vl_only(checkpoint: Path,
                                                              expected: tuple[list[list[int]], int]) -> None:
    """The same frames at 2 and 1 fps differ only in the seconds a temporal patch spans: Qwen2.5-VL's
    temporal positions follow them, so its tokens differ (a path that dropped the rate would fail the tests
    below); Qwen2-VL's do not, so its tokens are the same."""
    tokens, _ = expected
    timed = load_model_config(checkpoint).vision.tokens_per_second > 0  # type: ignore[union-attr]
    assert (tokens[0] != tokens[1]) == timed


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_disaggregated_preempted_and_cached_videos_keep_their_tokens(
        checkpoint: Path, expected: tuple[list[list[int]], int], caching: bool) -> None:
    """Disaggregated, a decode pool of pages for one request and a little: preempted requests recompute
    from their handed-over feature rows; asked again, with prefix caching the videos hit the caches (each
    distinct video and image encoded once). The same tokens every time."""
    tokens, longest = expected
    with LLM(model=checkpoint, mode="disaggregated", num_pages=-(-longest // 4) + 4, page_size=4,
             enable_prefix_caching=caching) as llm:
        first = llm.generate(REQUESTS, _greedy())
        again = llm.generate(REQUESTS, _greedy())
        assert llm.client is not None
        stats = llm.client.query_stats()
    assert [o.token_ids for o in first] == tokens and [o.token_ids for o in again] == tokens
    assert stats[("decode", 0)].num_preemptions > 0 and stats[("decode", 0)].num_encoded_images == 0
    if caching:
        # four distinct items (the two rates of one clip are distinct: their KV differs), each encoded once
        assert stats[("prefill", 0)].num_encoded_images == 4
        assert sum(o.num_cached_tokens for o in again) > 0


def test_a_follow_up_turn_reuses_the_video_turns_kv(checkpoint: Path) -> None:
    """A multi-turn chat about an MP4: the second turn reuses the first turn's KV (cached tokens reported)
    and answers as an engine without prefix caching does."""
    clip = encode_video(gradient_video(8, 56, 56, 6).frames, fps=4)
    first = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": clip}},
                                          {"type": "text", "text": "What happens in this clip?"}]}]
    cached = LLM(model=checkpoint, mode="colocated", num_pages=256, page_size=16)
    (answer,) = cached.generate({"messages": first}, _greedy(16))
    second = [*first, {"role": "assistant", "content": answer.text}, {"role": "user", "content": "And then?"}]
    (follow_up,) = cached.generate({"messages": second}, _greedy(16))
    plain = LLM(model=checkpoint, mode="colocated", num_pages=256, page_size=16, enable_prefix_caching=False)
    (uncached,) = plain.generate({"messages": second}, _greedy(16))
    assert follow_up.token_ids == uncached.token_ids
    assert follow_up.num_cached_tokens >= answer.num_prompt_tokens // 16 * 16 > 0


def test_decode_killed_mid_video_stream_migrates_with_the_same_tokens(
        checkpoint: Path, expected: tuple[list[list[int]], int]) -> None:
    """The decode worker is SIGKILLed mid-stream: the request is prefilled again elsewhere (its positions
    re-derived from the grids and the rate it carries) and ends with the fault-free tokens."""
    tokens, _ = expected
    assert_decode_kill_migrates(checkpoint, REQUESTS[2], _greedy(), tokens[2])
