"""Every family's caches key on image content, not shape: a repeated image hits the encoder cache and
shares its prefix pages; a different image of the same size, in the same place of the same prompt,
shares no page its span touches (the page hashes cover each image's own span) and is encoded anew.
The tokens stay those of an engine without prefix caching."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from mm_serve import LLM, SamplingParams
from mm_serve.models.registry import load_model_config
from tests.factories import build_checkpoint, gradient_image

Q = "USER: <image>\nWhat is in this picture? ASSISTANT:"
PAGE = 4
KINDS = ["llava", "llava-siglip", "llava-next", "llava-onevision", "fast-vlm", "qwen2-vl", "qwen2.5-vl"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_repeated_image_hits_and_a_different_one_of_its_size_shares_nothing(kind: str, tmp_path: Path) -> None:
    model_dir = build_checkpoint(kind, tmp_path / kind)
    first = {"prompt": Q, "images": [gradient_image(150, 90, 1)]}
    # the same size and prompt, the picture turned around
    other = {"prompt": Q, "images": [gradient_image(150, 90, 1).transpose(Image.Transpose.ROTATE_180)]}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = LLM(model=model_dir, mode="colocated", num_pages=256, page_size=PAGE, enable_prefix_caching=False)
    expected = [o.token_ids for o in plain.generate([first, other], params)]
    assert expected[0] != expected[1]  # the pixels reach the tokens, so sharing would show

    llm = LLM(model=model_dir, mode="colocated", num_pages=256, page_size=PAGE)
    assert llm.engine is not None
    vision = load_model_config(model_dir).vision
    assert vision is not None
    prompt = llm.engine.inputs.process(first).prompt_token_ids
    start = prompt.index(vision.image_token_index)
    end = len(prompt) - prompt[::-1].index(vision.image_token_index)  # one past the image's span
    assert llm.engine.inputs.process(other).prompt_token_ids == prompt  # same size: same count, same ids

    (a,) = llm.generate(first, params)
    (b,) = llm.generate(other, params)
    (again,) = llm.generate(first, params)
    assert [a.token_ids, b.token_ids, again.token_ids] == [expected[0], expected[1], expected[0]]
    assert b.num_cached_tokens <= start // PAGE * PAGE  # at most the text pages before the image
    assert again.num_cached_tokens >= end // PAGE * PAGE  # the image's pages and the text before it
    assert llm.engine.model.num_encoded_images == 2  # the repeat came from the caches
