"""LLaVA-NeXT (any-resolution tiling) against transformers' ``LlavaNextForConditionalGeneration`` and
``LlavaNextProcessor``: each image makes its own number of tokens, and our runner's greedy tokens equal
transformers' for images of every shape, alone and two at a time, colocated, disaggregated, with the
prefix and encoder caches hit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mm_serve import LLM, SamplingParams
from mm_serve.inputs.input_processor import ProcessedInputs
from mm_serve.models.llava_next.anyres import num_image_tokens, select_best_resolution
from tests.factories import build_checkpoint, gradient_image
from tests.golden import assert_matches_reference, reference_generate

NEW_TOKENS = 16
LOGITS_RTOL = 1e-4
Q = "USER: <image>\nWhat is in this picture? ASSISTANT:"
Q2 = "USER: <image>\nCompare this <image>\nwith the first one. ASSISTANT:"
IMAGES = {  # (width, height): wide, tall, tiny, large, square
    "wide": gradient_image(300, 40, 3), "tall": gradient_image(30, 200, 2), "tiny": gradient_image(3, 5, 4),
    "large": gradient_image(640, 480, 5), "square": gradient_image(80, 80, 6),
}
CASES: list[tuple[str, dict[str, Any]]] = [
    ("text", {"prompt": "Serving a language model means"}),
    *[(name, {"prompt": Q, "images": [image]}) for name, image in IMAGES.items()],
    ("tall-and-wide", {"prompt": Q2, "images": [IMAGES["tall"], IMAGES["wide"]]}),
]


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("llava-next", tmp_path_factory.mktemp("llava_next"))


@pytest.fixture(scope="module")
def reference(llava_next: Path) -> torch.nn.Module:
    from transformers import LlavaNextForConditionalGeneration

    return LlavaNextForConditionalGeneration.from_pretrained(str(llava_next), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def colocated(llava_next: Path) -> LLM:
    return LLM(model=llava_next, mode="colocated", num_pages=256, page_size=16)


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _model_kwargs(inputs: ProcessedInputs) -> dict[str, Any]:
    """transformers' image inputs for our processed images: every tile and each image's original size."""
    if inputs.pixel_values is None:
        return {}
    return {"pixel_values": inputs.pixel_values, "image_sizes": torch.tensor(inputs.image_sizes)}


@pytest.mark.parametrize("name,request_", CASES, ids=[c[0] for c in CASES])
def test_greedy_tokens_equal_transformers(colocated: LLM, reference: torch.nn.Module, name: str,
                                          request_: dict[str, Any]) -> None:
    assert_matches_reference(colocated, reference, request_, NEW_TOKENS, _model_kwargs, LOGITS_RTOL)


def test_each_image_makes_the_tokens_the_transformers_processor_counts(colocated: LLM, llava_next: Path) -> None:
    """Prompt ids (so every image's token count), tiles, original sizes and pixels equal
    ``LlavaNextProcessor``'s (Pillow backend); the counts differ by image size."""
    from transformers import AutoImageProcessor, AutoProcessor

    assert colocated.engine is not None
    processor = AutoProcessor.from_pretrained(str(llava_next),
                                              image_processor=AutoImageProcessor.from_pretrained(str(llava_next),
                                                                                                 backend="pil"))
    counts = {}
    for name, image in IMAGES.items():
        ours = colocated.engine.inputs.process({"prompt": Q, "images": [image]})
        theirs = processor(text=Q, images=[image], return_tensors="pt")
        assert ours.prompt_token_ids == theirs["input_ids"][0].tolist(), name
        assert ours.image_sizes == [tuple(theirs["image_sizes"][0].tolist())]
        assert ours.pixel_values is not None
        torch.testing.assert_close(ours.pixel_values, theirs["pixel_values"][0], rtol=0, atol=1e-5)
        counts[name] = ours.image_token_counts[0]
    assert counts == {"wide": 42, "tall": 52, "tiny": 28, "large": 70, "square": 88}  # 4:3 keeps 6 of 8 rows
    # the arithmetic alone: a 60x80 image is tiled 2x2 at 112 px and keeps 6 of the 8 feature rows
    assert select_best_resolution((60, 80), [[56, 112], [112, 56], [112, 112]]) == (112, 112)
    assert num_image_tokens((60, 80), [[56, 112], [112, 56], [112, 112]], 56, 14, True, True) == 6 * 8 + 6 + 16


def test_disaggregated_with_caches_equals_transformers(llava_next: Path, colocated: LLM,
                                                       reference: torch.nn.Module) -> None:
    """Prefill and decode in separate workers (the packed image rows handed over with the KV): the
    same tokens; asked again, the repeated images hit the encoder and prefix caches, same tokens."""
    assert colocated.engine is not None
    requests = [r for _, r in CASES if "images" in r][:3] + [dict(CASES[-1][1])]
    expected = [reference_generate(reference, inputs, NEW_TOKENS, _model_kwargs(inputs))[0]
                for inputs in map(colocated.engine.inputs.process, requests)]
    with LLM(model=llava_next, mode="disaggregated", num_pages=512) as llm:
        first = llm.generate(requests, _greedy())
        again = llm.generate(requests, _greedy())
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in again] == expected
    assert sum(o.num_cached_tokens for o in again) > 0


def test_low_detail_keeps_the_whole_image_tile_only(colocated: LLM, reference: torch.nn.Module) -> None:
    """``detail: low`` (OpenAI's): the whole-image tile alone, packed as transformers packs an image
    without tiles (its features and the newline): fewer tokens than ``high``/``auto``, and the greedy
    tokens of transformers' model fed those embeddings."""
    assert colocated.engine is not None
    image = IMAGES["large"]
    messages = lambda detail: [{"role": "user", "content": [  # noqa: E731
        {"type": "image_url", "image_url": {"url": image, "detail": detail}}, {"type": "text", "text": "What?"}]}]
    low = colocated.engine.inputs.process({"messages": messages("low")})
    high = colocated.engine.inputs.process({"messages": messages("high")})
    assert low.image_token_counts == [4 * 4 + 1] and high.image_token_counts == [70]  # 16 patches + newline
    assert low.image_tiles == [1] and high.image_tiles == [5]
    assert len(high.prompt_token_ids) - len(low.prompt_token_ids) == 70 - 17
    model = reference.model
    with torch.inference_mode():
        hidden = model.vision_tower(low.pixel_values, output_hidden_states=True).hidden_states[-2][:, 1:]
        features, _ = model.pack_image_features([model.multi_modal_projector(hidden)], torch.tensor(low.image_sizes),
                                                "default", image_newline=model.image_newline)
        ids = torch.tensor([low.prompt_token_ids])
        embeds = model.get_input_embeddings()(ids)
        embeds[ids == 4] = features[0]
        out = reference.generate(inputs_embeds=embeds, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
    ours = colocated.generate({"messages": messages("low")}, _greedy())[0]
    assert ours.token_ids == out[0].tolist() and ours.num_prompt_tokens == len(low.prompt_token_ids)


def test_preemption_recomputes_without_reencoding(llava_next: Path, colocated: LLM) -> None:
    """A decode pool too small for two tiled requests at once forces preemption: the same tokens
    as colocated, and the preempted requests recompute from the handed-over packed image rows
    instead of encoding their tiles again. Images of three shapes, so each carries its own count.

    120 output tokens each: any two requests fit the pool when handed over and outgrow it while they
    decode, and a decode lasts long enough that a loaded machine's prefills still overlap it."""
    images = [IMAGES["wide"], IMAGES["tall"], IMAGES["square"], IMAGES["large"]]
    requests = [{"prompt": Q, "images": [image]} for image in images]
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in colocated.generate(requests, params)]
    assert colocated.engine is not None
    longest = max(len(colocated.engine.inputs.process(r).prompt_token_ids) for r in requests) + 120
    with LLM(model=llava_next, mode="disaggregated", num_pages=-(-longest // 4) + 4, page_size=4) as llm:
        outputs = llm.generate(requests, params)
        assert llm.client is not None
        stats = llm.client.query_stats()
    assert [o.token_ids for o in outputs] == expected
    assert stats[("decode", 0)].num_preemptions > 0
    assert stats[("prefill", 0)].num_encoded_images == len(images)
    assert stats[("decode", 0)].num_encoded_images == 0


def test_decode_killed_mid_stream_continues_token_for_token(llava_next: Path, colocated: LLM) -> None:
    """SIGKILL on the decode worker while a tiled request streams: the request migrates (its tiles,
    sizes and per-image count travel with it) and finishes with the tokens of an undisturbed run."""
    from tests.test_fault_tolerance import assert_decode_kill_migrates

    request_ = {"prompt": Q2, "images": [IMAGES["large"], IMAGES["tall"]]}
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    (expected,) = colocated.generate(request_, params)
    assert_decode_kill_migrates(llava_next, request_, params, expected.token_ids, after_tokens=10)
