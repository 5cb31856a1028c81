"""LLaVA-OneVision (SigLIP tower, Qwen2 decoder, any-resolution tiles pooled to ``anyres_max_N``)
against transformers' ``LlavaOnevisionForConditionalGeneration`` and ``LlavaOnevisionProcessor``:
single images of every shape (grids pooled and not), several images in one prompt (one square-padded
tile each), colocated and disaggregated with the caches hit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mm_serve import LLM, SamplingParams
from mm_serve.inputs.input_processor import ProcessedInputs
from mm_serve.models.llava_next.anyres import max_image_tokens, num_image_tokens, pooled_grid
from mm_serve.models.registry import load_model_config
from tests.factories import build_checkpoint, gradient_image
from tests.golden import assert_matches_reference, reference_generate

NEW_TOKENS = 16
LOGITS_RTOL = 1e-4
Q = "USER: <image>\nWhat is in this picture? ASSISTANT:"
Q2 = "USER: <image>\nCompare this <image>\nwith the first one. ASSISTANT:"
IMAGES = {  # (width, height); "large" and "square" land on grids that are pooled
    "wide": gradient_image(300, 40, 3), "tall": gradient_image(30, 200, 2), "tiny": gradient_image(3, 5, 4),
    "large": gradient_image(640, 480, 5), "square": gradient_image(200, 190, 6),
}
CASES: list[tuple[str, dict[str, Any]]] = [
    ("text", {"prompt": "Serving a language model means"}),
    *[(name, {"prompt": Q, "images": [image]}) for name, image in IMAGES.items()],
    ("two-images", {"prompt": Q2, "images": [IMAGES["tall"], IMAGES["large"]]}),
]


@pytest.fixture(scope="module")
def onevision(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("llava-onevision", tmp_path_factory.mktemp("llava_onevision"))


@pytest.fixture(scope="module")
def reference(onevision: Path) -> torch.nn.Module:
    from transformers import LlavaOnevisionForConditionalGeneration

    return LlavaOnevisionForConditionalGeneration.from_pretrained(str(onevision), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def colocated(onevision: Path) -> LLM:
    return LLM(model=onevision, mode="colocated", num_pages=256, page_size=16)


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _model_kwargs(inputs: ProcessedInputs) -> dict[str, Any]:
    """transformers' inputs for our processed images: ``[images, tiles, 3, H, W]`` and the prompt's
    image count (which decides whether its images were tiled)."""
    if inputs.pixel_values is None:
        return {}
    tiles = torch.split(inputs.pixel_values, inputs.image_tiles)
    most = max(t.shape[0] for t in tiles)
    padded = torch.stack([torch.cat([t, t.new_zeros(most - t.shape[0], *t.shape[1:])]) for t in tiles])
    return {"pixel_values": padded, "image_sizes": torch.tensor(inputs.image_sizes),
            "batch_num_images": torch.tensor([len(tiles)])}


@pytest.mark.parametrize("name,request_", CASES, ids=[c[0] for c in CASES])
def test_greedy_tokens_equal_transformers(colocated: LLM, reference: torch.nn.Module, name: str,
                                          request_: dict[str, Any]) -> None:
    assert_matches_reference(colocated, reference, request_, NEW_TOKENS, _model_kwargs, LOGITS_RTOL)


def test_prompt_ids_and_pixels_equal_the_transformers_processor(colocated: LLM, onevision: Path) -> None:
    """Prompt ids (so every image's token count, pooled or not), tiles, sizes and pixels equal
    ``LlavaOnevisionProcessor``'s (Pillow backend), one image at a time and two in one prompt."""
    from transformers import (
        LlavaOnevisionImageProcessorPil,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    assert colocated.engine is not None
    processor = LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessorPil.from_pretrained(str(onevision)),
        video_processor=LlavaOnevisionVideoProcessor(),  # unused: no video here
        tokenizer=colocated.engine.inputs.tokenizer, num_image_tokens=16, vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_4", image_token="<image>")
    counts = {}
    for name, request_ in CASES[1:]:
        ours = colocated.engine.inputs.process(request_)
        theirs = processor(text=request_["prompt"], images=[request_["images"]], return_tensors="pt")
        assert ours.prompt_token_ids == theirs["input_ids"][0].tolist(), name
        assert ours.image_sizes == [tuple(s) for s in theirs["image_sizes"].tolist()], name
        assert ours.pixel_values is not None
        expected = torch.cat([p[:t] for p, t in zip(theirs["pixel_values"], ours.image_tiles, strict=True)])
        torch.testing.assert_close(ours.pixel_values, expected, rtol=0, atol=1e-5)
        counts[name] = ours.image_token_counts
    # square and large tile 4x4 (16x16 positions): square pooled by 2 to 8x8; large keeps 12 of 16 rows,
    # pooled by sqrt(3) to 6x9; each + its newlines + 16 base positions. Two images: 16 + a newline each
    assert (counts["square"], counts["large"], counts["two-images"]) == ([8 * 8 + 8 + 16], [6 * 9 + 6 + 16], [17, 17])
    assert counts["wide"] == [2 * 16 + 2 + 16]  # a 1x4 grid keeps 2 of 4 rows: under the cap, not pooled


def test_pooling_arithmetic() -> None:
    """``anyres_max_N``: a map is pooled only when its side exceeds the cap's by more than 10 %, then
    both sides are divided by the ratio and floored; the ring's bound holds over many sizes."""
    assert pooled_grid(8, 8, 4, 4) == (8, 8)  # 64 positions: exactly 4 tiles of 16
    assert pooled_grid(9, 8, 4, 4) == (9, 8)  # ratio 1.06: kept
    assert pooled_grid(16, 16, 4, 4) == (8, 8)  # ratio 2
    assert pooled_grid(12, 16, 4, 4) == (6, 9)  # ratio sqrt(3) = 1.73: 6.93 -> 6, 9.24 -> 9
    assert pooled_grid(16, 16, 4, 0) == (16, 16)  # LLaVA-NeXT: never
    pinpoints = [[56, 56], [56, 112], [112, 56], [112, 112], [56, 224], [224, 56], [168, 168], [224, 224]]
    bound = max_image_tokens(pinpoints, 56, 14, False, False, 4)
    sizes = [(h, w) for h in range(1, 700, 37) for w in range(1, 700, 41)]
    most = max(num_image_tokens(s, pinpoints, 56, 14, False, False, 4) for s in sizes)
    assert most <= bound < max_image_tokens(pinpoints, 56, 14, False, False, 0)


def test_disaggregated_with_caches_equals_transformers(onevision: Path, colocated: LLM,
                                                       reference: torch.nn.Module) -> None:
    """Prefill and decode in separate workers: the same tokens; asked again, the repeated images hit
    the encoder and prefix caches, same tokens. The checkpoint reads as its own family."""
    assert load_model_config(onevision).model_type == "llava_onevision"
    assert colocated.engine is not None
    requests = [r for name, r in CASES if name in ("square", "wide", "two-images")]
    expected = [reference_generate(reference, inputs, NEW_TOKENS, _model_kwargs(inputs))[0]
                for inputs in map(colocated.engine.inputs.process, requests)]
    with LLM(model=onevision, mode="disaggregated", num_pages=512) as llm:
        first = llm.generate(requests, _greedy())
        again = llm.generate(requests, _greedy())
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in again] == expected
    assert sum(o.num_cached_tokens for o in again) > 0
