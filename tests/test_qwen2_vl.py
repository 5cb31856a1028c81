"""Qwen2-VL (a ViT with 2-D rotary positions over each image's own patch grid, a 2x2 patch merger, a
Qwen2 decoder with M-RoPE) and Qwen2.5-VL (its ViT attending within windows) against transformers'
``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration`` and ``Qwen2VLProcessor``: text,
images of every shape, one at the pixel floor and one at the ceiling, two of different sizes in one prompt,
``detail`` low, short videos (alone, with an image, decoded from an MP4, sampled at a request's fps). Disaggregated, preempted, cached and migrated runs are
in tests/test_family_faults.py and test_family_caches.py (kind ``qwen2-vl``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mm_serve import LLM, SamplingParams
from mm_serve.inputs.input_processor import ProcessedInputs
from mm_serve.media.video_loading import encode_video
from mm_serve.models.builder import QWEN2_VL_PIXELS
from mm_serve.models.qwen2_vl.mrope import mrope_positions
from mm_serve.models.registry import load_model_config
from tests.factories import build_checkpoint, gradient_image, gradient_video
from tests.golden import assert_matches_reference, reference_generate

NEW_TOKENS = 16
LOGITS_RTOL = 1e-4
Q = "USER: <image>\nWhat is in this picture? ASSISTANT:"
Q2 = "USER: <image>\nCompare this <image>\nwith the first one. ASSISTANT:"
IMAGES = {  # (width, height)
    "wide": gradient_image(300, 40, 3), "tall": gradient_image(30, 200, 2),
    "tiny": gradient_image(3, 5, 4),  # scaled up to the pixel floor
    "large": gradient_image(640, 480, 5),  # scaled down to the pixel ceiling
    "square": gradient_image(80, 80, 6),
}
QV = "USER: <video>\nWhat happens in this video? ASSISTANT:"
QIV = "USER: <image>\nHere is a picture, and <video>\na video. What changes? ASSISTANT:"
VIDEOS = {
    "video": gradient_video(6, 84, 56, 1),  # 3 temporal patches
    "odd-frames": gradient_video(5, 40, 70, 2, fps=1.5),  # the last frame repeated to fill a patch
    # 10 temporal patches a second apart: Qwen2.5-VL's temporal ids (4 a second) pass the text after the video,
    # and generation continues from the last token, not the largest id (transformers' generate)
    "long": gradient_video(20, 56, 56, 5, fps=2.0),
}
CASES: list[tuple[str, dict[str, Any]]] = [
    ("text", {"prompt": "Serving a language model means"}),
    *[(name, {"prompt": Q, "images": [image]}) for name, image in IMAGES.items()],
    ("two-images", {"prompt": Q2, "images": [IMAGES["tall"], IMAGES["wide"]]}),
    *[(name, {"prompt": QV, "videos": [video]}) for name, video in VIDEOS.items()],
    ("image-and-video", {"prompt": QIV, "images": [IMAGES["square"]], "videos": [VIDEOS["video"]]}),
]


@pytest.fixture(scope="module", params=["qwen2-vl", "qwen2.5-vl"])
def qwen2_vl(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def reference(qwen2_vl: Path) -> torch.nn.Module:
    import transformers

    family = load_model_config(qwen2_vl).raw["architectures"][0]
    return getattr(transformers, family).from_pretrained(str(qwen2_vl), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(qwen2_vl: Path) -> Any:
    from transformers import (
        AutoTokenizer,
        Qwen2VLImageProcessorPil,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(str(qwen2_vl)),
                            tokenizer=AutoTokenizer.from_pretrained(str(qwen2_vl)),
                            video_processor=Qwen2VLVideoProcessor.from_pretrained(str(qwen2_vl)))


@pytest.fixture(scope="module")
def colocated(qwen2_vl: Path) -> LLM:
    return LLM(model=qwen2_vl, mode="colocated", num_pages=256, page_size=16)


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _model_kwargs(inputs: ProcessedInputs, reference: torch.nn.Module | None = None) -> dict[str, Any]:
    """transformers' inputs for our processed images and videos: their patches apart, which tokens are image
    (1) and video (2) tokens (its M-RoPE needs them), each one's grid and (Qwen2.5-VL) each video's seconds
    per temporal patch."""
    if inputs.pixel_values is None:
        return {}
    ids = torch.tensor([inputs.prompt_token_ids])
    rows = torch.split(inputs.pixel_values, inputs.image_tiles)
    stills = [i for i, size in enumerate(inputs.image_sizes) if len(size) == 2]
    videos = [i for i, size in enumerate(inputs.image_sizes) if len(size) == 3]
    kwargs: dict[str, Any] = {"mm_token_type_ids": (ids == 4).int() + 2 * (ids == 5).int()}
    if stills:
        kwargs.update(pixel_values=torch.cat([rows[i] for i in stills]),
                      image_grid_thw=torch.tensor([[1, *inputs.image_sizes[i]] for i in stills]))
    if videos:
        kwargs.update(pixel_values_videos=torch.cat([rows[i] for i in videos]),
                      video_grid_thw=torch.tensor([list(inputs.image_sizes[i]) for i in videos]))
        if reference is None or "2_5" in type(reference).__name__:
            kwargs["second_per_grid_ts"] = torch.tensor([inputs.image_second_per_grid[i] for i in videos])
    return kwargs


@pytest.mark.parametrize("name, request_", CASES, ids=[c[0] for c in CASES])
def test_tokens_equal_transformers(name: str, request_: dict[str, Any], colocated: LLM, reference: torch.nn.Module,
                                   processor: Any) -> None:
    """Prompt ids, patches and grids equal the processor's (a video's frames through its video processor);
    first logits within 1e-4; greedy tokens equal."""
    assert colocated.engine is not None
    inputs = colocated.engine.inputs.process(request_)
    videos = [video.frames for video in request_.get("videos", [])]
    theirs = processor(text=[request_["prompt"]], images=request_.get("images"), videos=videos or None,
                       do_sample_frames=False, return_tensors="pt")
    assert inputs.prompt_token_ids == theirs["input_ids"][0].tolist()
    kwargs = _model_kwargs(inputs, reference)
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        assert (key in kwargs) == (key in theirs)
        if key in kwargs:
            assert torch.equal(kwargs[key], theirs[key]), key
    if videos:
        assert inputs.image_second_per_grid == [0.0] * (len(inputs.image_sizes) - len(videos)) + [
            2 / video.fps for video in request_["videos"]]
    assert_matches_reference(colocated, reference, request_, NEW_TOKENS, lambda i: _model_kwargs(i, reference),
                             LOGITS_RTOL)


def test_pixel_bounds_decide_the_token_counts(colocated: LLM, qwen2_vl: Path) -> None:
    """A tiny image is scaled up to the pixel floor, a large one down to the ceiling; the engine's
    bounds are the checkpoint's preprocessor's."""
    vision = load_model_config(qwen2_vl).vision
    assert vision is not None and vision.pixel_bounds == QWEN2_VL_PIXELS and vision.merge_size == 2
    assert colocated.engine is not None
    token = 28 * 28  # pixels per merged token
    tiny = colocated.engine.inputs.process({"prompt": Q, "images": [IMAGES["tiny"]]})
    large = colocated.engine.inputs.process({"prompt": Q, "images": [IMAGES["large"]]})
    assert tiny.image_token_counts[0] * token >= QWEN2_VL_PIXELS[0]
    assert large.image_token_counts[0] * token <= QWEN2_VL_PIXELS[1] == vision.max_image_tokens * token
    assert large.image_token_counts[0] > 2 * tiny.image_token_counts[0]


def test_images_reach_the_tokens(colocated: LLM) -> None:
    """The same prompt with two different images of one size gives different tokens (the tower's
    features matter, so the parity above could fail)."""
    a, b = colocated.generate([{"prompt": Q, "images": [IMAGES["square"]]},
                               {"prompt": Q, "images": [gradient_image(80, 80, 7)]}], _greedy())
    assert a.token_ids != b.token_ids


def test_detail_low_caps_the_pixels(colocated: LLM, reference: torch.nn.Module) -> None:
    """``detail: low`` caps an image at a 512 x 512 image's pixels: under this checkpoint's smaller
    ceiling it changes nothing; the chat path takes it and stays exact."""
    assert colocated.engine is not None
    part = {"type": "image_url", "image_url": {"url": IMAGES["large"], "detail": "low"}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "Describe it."}]}]
    inputs = colocated.engine.inputs.process({"messages": messages})
    high = colocated.engine.inputs.process({"prompt": Q, "images": [IMAGES["large"]]})
    assert inputs.image_token_counts == high.image_token_counts
    expected, _ = reference_generate(reference, inputs, NEW_TOKENS, _model_kwargs(inputs, reference))
    assert colocated.generate({"messages": messages}, _greedy())[0].token_ids == expected


def test_positions_continue_after_the_prompt() -> None:
    """M-RoPE ids: text counts up, an image's tokens take (row, column) offsets from where the text left
    off, the text after it resumes past the image's longer side, and ``delta`` continues the last token's."""
    ids = [7, 7, 4, 4, 4, 4, 4, 4, 7]  # 2 text, a 2x3 merged image (a 4x6 patch grid), 1 text
    positions, delta = mrope_positions(ids, 4, [6], [(4, 6)], 2)
    assert positions.tolist() == [[0, 1, 2, 2, 2, 2, 2, 2, 5],
                                  [0, 1, 2, 2, 2, 3, 3, 3, 5],
                                  [0, 1, 2, 3, 4, 2, 3, 4, 5]]
    assert delta == 5 + 1 - len(ids)
    with pytest.raises(ValueError, match="cannot have the grid"):
        mrope_positions(ids, 4, [6], [(4, 4)], 2)


def test_mm_processor_kwargs_set_the_pixel_bounds(colocated: LLM, reference: torch.nn.Module, processor: Any) -> None:
    """``mm_processor_kwargs`` (vLLM's name) narrows the pixel bounds: the patches and grid are the
    processor's under the same bounds, the tokens stay exact; bounds outside the checkpoint's, unknown
    keys and min over max are refused naming the field."""
    from mm_serve.inputs.input_processor import InvalidRequestError

    assert colocated.engine is not None
    bounds = {"min_pixels": QWEN2_VL_PIXELS[0], "max_pixels": 28 * 28 * 16}
    request_ = {"prompt": Q, "images": [IMAGES["large"]], "mm_processor_kwargs": bounds}
    inputs = colocated.engine.inputs.process(request_)
    full = colocated.engine.inputs.process({"prompt": Q, "images": [IMAGES["large"]]})
    assert inputs.image_token_counts[0] <= 16 < full.image_token_counts[0]
    theirs = processor(text=[Q], images=[IMAGES["large"]], return_tensors="pt",
                       size={"shortest_edge": bounds["min_pixels"], "longest_edge": bounds["max_pixels"]})
    assert inputs.prompt_token_ids == theirs["input_ids"][0].tolist()
    assert torch.equal(inputs.pixel_values, theirs["pixel_values"])
    expected, _ = reference_generate(reference, inputs, NEW_TOKENS, _model_kwargs(inputs, reference))
    assert colocated.generate(request_, _greedy())[0].token_ids == expected
    for kwargs, message in [({"max_pixels": QWEN2_VL_PIXELS[1] + 1}, "this model takes"),
                            ({"min_pixels": 10}, "this model takes"),
                            ({"min_pixels": 28 * 28 * 16, "max_pixels": 28 * 28 * 8}, "min_pixels <= max_pixels"),
                            ({"num_frames": 2}, "takes min_pixels and max_pixels"),
                            ({"fps": 0}, "fps must be a number"),
                            ({"max_frames": 10_000}, "max_frames must be an integer in")]:
        with pytest.raises(InvalidRequestError, match=message) as caught:
            colocated.engine.inputs.process({**request_, "mm_processor_kwargs": kwargs})
        assert caught.value.param == "mm_processor_kwargs"


def test_mm_processor_kwargs_are_refused_where_images_have_a_fixed_size(tmp_path: Path) -> None:
    from mm_serve.inputs.input_processor import InvalidRequestError

    llm = LLM(model=build_checkpoint("llava", tmp_path / "llava"), mode="colocated", num_pages=64, page_size=16)
    assert llm.engine is not None
    with pytest.raises(InvalidRequestError, match="applies to models that resize"):
        llm.engine.inputs.process({"prompt": Q, "images": [IMAGES["square"]], "mm_processor_kwargs": {"max_pixels": 9999}})


def test_a_follow_up_turn_reuses_the_first_turns_kv(qwen2_vl: Path, colocated: LLM) -> None:
    """A multi-turn image chat: the second turn's prompt begins with the first turn (image included), whose
    M-RoPE positions do not depend on what follows, so its KV is reused (cached tokens reported) and the
    answer equals an engine's without prefix caching."""
    first = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGES["wide"]}},
                                          {"type": "text", "text": "What is in this picture?"}]}]
    (answer,) = colocated.generate({"messages": first}, _greedy())
    second = [*first, {"role": "assistant", "content": answer.text},
              {"role": "user", "content": "And what colour is it?"}]
    (follow_up,) = colocated.generate({"messages": second}, _greedy())
    plain = LLM(model=qwen2_vl, mode="colocated", num_pages=256, page_size=16, enable_prefix_caching=False)
    (uncached,) = plain.generate({"messages": second}, _greedy())
    assert follow_up.token_ids == uncached.token_ids
    assert follow_up.num_cached_tokens >= answer.num_prompt_tokens // 16 * 16 > 0


def test_an_image_the_processor_refuses_is_a_clear_error(colocated: LLM) -> None:
    """Qwen2-VL's processor refuses an aspect ratio over 200: an ImageError (a 400 on the API) naming the
    image, not a bare ValueError from transformers (a 500); the offline API raises it as InvalidRequestError,
    as every other bad input."""
    from mm_serve.media.errors import ImageError

    assert colocated.engine is not None
    with pytest.raises(ImageError, match=r"image 2 \(1x3000 px\) cannot be preprocessed for this model"):
        colocated.engine.inputs.process({"prompt": Q2, "images": [IMAGES["square"], gradient_image(1, 3000)]})
    from mm_serve.inputs.input_processor import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=r"^image: image 2 \(1x3000 px\) cannot be preprocessed"):
        colocated.generate({"prompt": Q2, "images": [IMAGES["square"], gradient_image(1, 3000)]})  # as other bad input


def test_a_misspelt_request_key_is_refused(colocated: LLM) -> None:
    """A key the engine does not read is an error naming it, not silently dropped (``mm_processor_kwarg``
    for ``mm_processor_kwargs`` would otherwise serve the checkpoint's bounds without a word)."""
    from mm_serve.inputs.input_processor import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="unknown request key.*'mm_processor_kwarg'"):
        colocated.generate({"prompt": Q, "images": [IMAGES["square"]], "mm_processor_kwarg": {"max_pixels": 3136}})


def test_a_video_file_is_sampled_at_the_requested_rate(colocated: LLM, reference: torch.nn.Module) -> None:
    """An MP4 in a chat's ``video_url`` part is decoded (PyAV) and sampled at ``mm_processor_kwargs.fps``
    (at most ``max_frames``): fewer frames, fewer tokens, each a temporal patch of 2 frames; the tokens stay
    exact against transformers given the same sampled frames, and the video token is counted in the prompt."""
    assert colocated.engine is not None
    clip = encode_video(gradient_video(16, 56, 56, 3).frames, fps=8)  # 2 s at 8 fps
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": clip}},
                                             {"type": "text", "text": "What happens?"}]}]
    rates = {}
    for fps, frames in [(2.0, 4), (4.0, 8), (8.0, 16)]:
        inputs = colocated.engine.inputs.process({"messages": messages, "mm_processor_kwargs": {"fps": fps}})
        t, h, w = inputs.image_sizes[0]
        assert (t, h, w) == (frames // 2, 4, 4) and inputs.image_token_counts == [4 * t]  # 56 px: 4x4 patches
        assert inputs.image_second_per_grid == [pytest.approx(2 / fps)]
        rates[fps] = inputs
    capped = colocated.engine.inputs.process({"messages": messages, "mm_processor_kwargs": {"fps": 8.0, "max_frames": 6}})
    assert capped.image_sizes[0][0] == 3 and capped.image_second_per_grid == [pytest.approx(2 / 3)]  # 6 frames in 2 s
    expected, _ = reference_generate(reference, rates[2.0], NEW_TOKENS, _model_kwargs(rates[2.0], reference))
    assert colocated.generate({"messages": messages}, _greedy())[0].token_ids == expected


def test_videos_reach_the_tokens(colocated: LLM) -> None:
    """Two different videos of one shape give different tokens (so the video parity above could fail), and so
    does one video at two frame rates on Qwen2.5-VL (its temporal positions follow the clock)."""
    a, b = colocated.generate([{"prompt": QV, "videos": [gradient_video(6, 84, 56, 1)]},
                               {"prompt": QV, "videos": [gradient_video(6, 84, 56, 9)]}], _greedy())
    assert a.token_ids != b.token_ids


def test_bad_videos_are_clear_errors(colocated: LLM, tmp_path: Path) -> None:
    """Not a video, a still image, a truncated file, too long, a video where the prompt has no placeholder:
    each an error naming the problem, and the engine serves the next request."""
    from mm_serve.inputs.input_processor import InvalidRequestError

    assert colocated.engine is not None
    clip = encode_video(gradient_video(8, 56, 56, 4).frames, fps=4)
    png = tmp_path / "still.png"
    IMAGES["square"].save(png)
    for video, message in [(b"not a video at all" * 20, "not a readable video"), (str(png), "still image"),
                           (clip[: len(clip) // 3], "not a readable video|no decodable frame"),
                           ([IMAGES["square"], IMAGES["wide"]], "one size")]:
        with pytest.raises(InvalidRequestError, match=message):
            colocated.engine.inputs.process({"prompt": QV, "videos": [video]})
    with pytest.raises(InvalidRequestError, match=r"prompt has 0 video placeholder\(s\) \(<video>\) but 1 video"):
        colocated.engine.inputs.process({"prompt": Q, "images": [IMAGES["square"]], "videos": [clip]})
    (ok,) = colocated.generate({"prompt": QV, "videos": [clip]}, _greedy())
    assert len(ok.token_ids) == NEW_TOKENS


def test_video_positions_follow_the_clock() -> None:
    """Qwen2.5-VL: a video's temporal positions step by ``tokens_per_second`` x seconds per temporal patch
    (floored in float32, as transformers); Qwen2-VL (``tokens_per_second`` 0) by one."""
    ids = [7, 5, 5, 5, 7]  # a video of 3 temporal patches of one merged token each
    positions, _ = mrope_positions(ids, (4, 5), [3], [(3, 2, 2)], 2, [2 / 3], 4.0)
    assert positions[0].tolist() == [0, 1, 1 + 2, 1 + 5, 2]  # floor(0, 2.67, 5.33) after the text
    plain, _ = mrope_positions(ids, (4, 5), [3], [(3, 2, 2)], 2, [2 / 3], 0.0)
    assert plain[0].tolist() == [0, 1, 2, 3, 2]
    _, delta = mrope_positions(ids, (4, 5), [3], [(3, 2, 2)], 2, [2 / 3], 4.0)
    assert delta == 2 + 1 - len(ids)  # from the last token (2), not the video's largest temporal id (6)
