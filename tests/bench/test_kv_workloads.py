"""The KV-sharing workloads: turn structure, the history each turn sends, shared prompts, repeated images."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from mm_serve.bench.conversations import (
    History,
    conversation_arrivals,
    request_chains,
    whole_conversations,
)
from mm_serve.bench.requests import RequestFactory
from mm_serve.workloads import (
    BUILTIN_WORKLOADS,
    CaptionRepeatWorkload,
    MultiturnLlavaWorkload,
    SharedPromptWorkload,
    WorkloadError,
    is_conversational,
    make_workload,
)
from mm_serve.workloads.spec import RequestSpec


def test_multiturn_sample_is_whole_conversations_of_five_turns() -> None:
    wl = make_workload("multiturn-llava", image_tokens=16, max_context=4096)
    assert isinstance(wl, MultiturnLlavaWorkload) and is_conversational(wl)
    rows = wl.sample(7, seed=0)
    assert [(r.conversation_id, r.turn) for r in rows] == [(f"c{c}", t) for c in range(2) for t in range(5)]
    assert [r.num_images for r in rows] == [1, 0, 0, 0, 0] * 2
    assert [r.image_tokens for r in rows] == [16, 0, 0, 0, 0] * 2
    assert all(4 <= r.prompt_tokens <= 128 and 4 <= r.output_tokens <= 256 for r in rows)
    assert wl.sample(3, seed=0) == rows[:5]  # prefix-consistent, whole conversation
    assert wl.sample(7, seed=1) != rows


def test_multiturn_conversation_fits_the_context() -> None:
    rows = MultiturnLlavaWorkload(image_tokens=300, max_context=400).sample(5, seed=3)
    history = 300 + sum(r.prompt_tokens + r.output_tokens + 16 for r in rows)
    assert history <= 400 and rows[0].turn == 0 and len(rows) >= 1


def test_image_workloads_need_a_vision_tower_and_other_workloads_are_not_conversational() -> None:
    for name in ("multiturn-llava", "caption-repeat"):
        with pytest.raises(WorkloadError, match="vision tower"):
            make_workload(name, image_tokens=0)
    assert {"multiturn-llava", "shared-prompt", "caption-repeat"} <= set(BUILTIN_WORKLOADS)
    assert not is_conversational(make_workload("shared-prompt"))
    assert not is_conversational(make_workload("caption-repeat", image_tokens=16))


def _body(factory: RequestFactory, spec: RequestSpec, index: int, salt: int = 0) -> dict[str, Any]:
    return dict(json.loads(factory.body(spec, index, salt)))


def test_each_turn_sends_the_whole_history() -> None:
    factory = RequestFactory("m", image_size=16)
    specs = MultiturnLlavaWorkload(image_tokens=16).sample(5, seed=0)
    plan = factory.plan(specs, [0.0] * 5)
    assert [(p.conversation, p.turn) for p in plan] == [("c0", t) for t in range(5)]
    history, sent = History(), []
    for p in plan:
        sent.append(json.loads(history.body(p)))
        history.answered(p, f"answer {p.turn}")
    first_user = sent[0]["messages"][0]
    assert [part["type"] for part in first_user["content"]] == ["image_url", "text"]
    for k, body in enumerate(sent):
        messages = body["messages"]
        assert len(messages) == 2 * k + 1
        assert messages[0] == first_user  # the same image_url part, byte for byte, every turn
        assert [m["role"] for m in messages] == ["user", "assistant"] * k + ["user"]
        assert [m["content"] for m in messages[1::2]] == [f"answer {t}" for t in range(k)]
        if k:  # the previous turn's messages, then its answer
            assert messages[:-1] == [*sent[k - 1]["messages"], {"role": "assistant", "content": f"answer {k - 1}"}]
        assert messages[-1] == json.loads(plan[k].body)["messages"][0]  # the turn's own question
        assert body["max_tokens"] == specs[k].output_tokens
    assert all(isinstance(m["content"], str) for s in sent[1:] for m in s["messages"][1:])


def test_chains_and_start_times_of_conversations() -> None:
    specs = [RequestSpec(4, 2, conversation_id="a", turn=0), RequestSpec(4, 2, conversation_id="a", turn=1),
             RequestSpec(4, 2), RequestSpec(4, 2, conversation_id="b", turn=0)]
    # 3 starts for 4 requests: 4/3 requests per start; at 2 req/s a unit time t becomes t * 4/3 / 2
    assert conversation_arrivals(specs, [1.0, 3.0, 6.0], rate=2.0) == pytest.approx([2 / 3, 2 / 3, 2.0, 4.0])
    with pytest.raises(ValueError, match="3 conversations but 2"):
        conversation_arrivals(specs, [1.0, 2.0], rate=1.0)
    plan = RequestFactory("m").plan(specs, [0.0] * 4)
    assert request_chains(plan) == [[0, 1], [2], [3]]
    assert whole_conversations(specs, 1) == specs[:2]
    assert whole_conversations(specs, 3) == specs[:3] and whole_conversations(specs, 9) == specs


def test_shared_prompt_is_identical_within_a_run_and_salted_across_runs() -> None:
    wl = make_workload("shared-prompt")
    assert isinstance(wl, SharedPromptWorkload)
    specs = wl.sample(6, seed=0)
    assert all(s.shared_prefix_tokens == 400 and 404 <= s.prompt_tokens <= 464 for s in specs)
    factory = RequestFactory("m")
    bodies = [_body(factory, s, i, salt=5) for i, s in enumerate(specs)]
    systems = [b["messages"][0] for b in bodies]
    assert all(m == {"role": "system", "content": systems[0]["content"]} for m in systems)
    assert 1500 <= len(systems[0]["content"]) <= 1600  # ~4 characters per token without a tokenizer
    questions = [b["messages"][1]["content"] for b in bodies]
    assert len(set(questions)) == 6 and [b["messages"][1]["role"] for b in bodies] == ["user"] * 6
    assert _body(factory, specs[0], 0, salt=6)["messages"][0] != systems[0]
    completion = json.loads(RequestFactory("m", api="completions").body(specs[0], 0, 5))
    assert completion["prompt"].startswith(systems[0]["content"] + "\n\n")


def test_caption_repeat_sends_each_image_three_times_shuffled() -> None:
    wl = make_workload("caption-repeat", image_tokens=16)
    assert isinstance(wl, CaptionRepeatWorkload)
    rows = wl.sample(24, seed=0)
    assert Counter(r.image_seed for r in rows) == {i: 3 for i in range(8)}
    assert {r.image_seed for r in rows[:12]} == {0, 1, 2, 3}  # blocks of 4 images
    assert [r.image_seed for r in rows] != sorted(r.image_seed or 0 for r in rows)
    assert wl.sample(12, seed=0) == rows[:12] and wl.sample(30, seed=0)[:24] == rows
    assert all(r.num_images == 1 and r.prompt_tokens == 12 and 20 <= r.output_tokens <= 40 for r in rows)
    factory = RequestFactory("m", image_size=16)
    bodies = [_body(factory, r, i, salt=1)["messages"][0]["content"] for i, r in enumerate(rows)]
    by_image: dict[int, list[Any]] = {}
    for r, content in zip(rows, bodies, strict=True):
        by_image.setdefault(r.image_seed or 0, []).append(content)
    assert all(c == contents[0] for contents in by_image.values() for c in contents)  # same bytes, same text
    urls = {contents[0][0]["image_url"]["url"] for contents in by_image.values()}
    assert len(urls) == 8
    assert _body(factory, rows[0], 0, salt=2)["messages"][0]["content"] != bodies[0]


def test_a_tiling_family_is_sent_images_of_mixed_shapes() -> None:
    """For LLaVA-NeXT the bench draws each image's (width, height) from the tower's square, the grid
    resolutions and their halves, so image-token counts vary; a fixed-size family gets its square."""
    import base64
    import io
    from dataclasses import replace

    from PIL import Image

    from mm_serve.bench.requests import image_shapes
    from mm_serve.models.model_config import VisionConfig

    vision = VisionConfig(hf_config={}, tower="clip_vision_model", class_token=True, image_size=56, patch_size=14,
                          hidden_size=64, image_token_index=4, feature_layers=(-2,), feature_layer_is_list=False,
                          select_strategy="default", projector_hidden_act="gelu", projector_bias=True)
    assert image_shapes(vision) == [(56, 56)] and image_shapes(None) == [(336, 336)]
    tiled = replace(vision, grid_pinpoints=((56, 112), (112, 112)))
    shapes = image_shapes(tiled)
    assert shapes == [(56, 56), (112, 56), (56, 28), (112, 112)]
    factory = RequestFactory("m", image_size=shapes)
    spec = RequestSpec(8, 4, num_images=2)
    sizes = set()
    for i in range(40):
        for part in _body(factory, spec, i)["messages"][0]["content"][:2]:
            data = base64.b64decode(part["image_url"]["url"].partition(",")[2])
            sizes.add(Image.open(io.BytesIO(data)).size)
    assert sizes == set(shapes)
    assert _body(factory, spec, 3) == _body(RequestFactory("m", image_size=shapes), spec, 3)  # seeded


def test_a_dynamic_resolution_model_gets_images_from_its_pixel_floor_to_its_ceiling(tmp_path: Path) -> None:
    """On Qwen2-VL the bench's shapes make from the fewest tokens the checkpoint allows to the most
    (by its own processor), so a bench run mixes image sizes."""
    from mm_serve.bench.requests import image_shapes
    from mm_serve.inputs.input_processor import InputProcessor
    from mm_serve.models.builder import QWEN2_VL_PIXELS
    from mm_serve.models.registry import load_model_config
    from tests.factories import build_checkpoint, gradient_image

    model_dir = build_checkpoint("qwen2-vl", tmp_path / "qwen2-vl")
    config = load_model_config(model_dir)
    assert config.vision is not None
    inputs = InputProcessor(model_dir, config)
    counts = [inputs.process({"prompt": "<image>", "images": [gradient_image(w, h)]}).image_token_counts[0]
              for w, h in image_shapes(config.vision)]
    assert min(counts) == QWEN2_VL_PIXELS[0] // 28**2 and max(counts) == QWEN2_VL_PIXELS[1] // 28**2
    assert len(set(counts)) >= 3


def test_the_short_video_workload_sends_clips_the_model_turns_into_the_tokens_it_plans(tmp_path: Path) -> None:
    """``short-video`` on Qwen2.5-VL: each request one MP4 clip of a drawn frame size, which the server's
    default sampling (2 fps) makes into at most the tokens the workload planned per video; refused for a
    model that takes no video, and seeded."""
    from mm_serve.bench.requests import CLIP_FRAMES, video_shapes, video_tokens
    from mm_serve.inputs.input_processor import InputProcessor
    from mm_serve.media.video_loading import VideoLimits, decode_video_data_uri
    from mm_serve.models.registry import load_model_config
    from mm_serve.workloads import WorkloadError, make_workload
    from tests.factories import build_checkpoint

    model_dir = build_checkpoint("qwen2.5-vl", tmp_path / "qwen2.5-vl")
    config = load_model_config(model_dir)
    assert config.vision is not None
    planned = video_tokens(config.vision)
    workload = make_workload("short-video", 0, 4096, planned)
    specs = workload.sample(6, seed=1)
    assert all(s.num_videos == 1 and s.total_prompt_tokens == s.prompt_tokens + planned for s in specs)
    assert workload.sample(6, seed=1) == specs
    factory = RequestFactory("m", video_shapes=video_shapes(config.vision))
    inputs = InputProcessor(model_dir, config)
    counts = set()
    for i, spec in enumerate(specs):
        (part, _) = _body(factory, spec, i)["messages"][0]["content"]
        video = decode_video_data_uri(part["video_url"]["url"], VideoLimits())
        assert video.frames.shape[0] == CLIP_FRAMES // 2  # 2 s at the default 2 fps
        counts.add(inputs.process({"prompt": "<video>", "videos": [video]}).image_token_counts[0])
    assert max(counts) == planned and len(counts) == len(video_shapes(config.vision)) == 2  # mixed sizes
    with pytest.raises(WorkloadError, match="takes video"):
        make_workload("short-video", 576, 4096, 0)
