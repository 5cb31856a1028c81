"""Our ImageProcessor against transformers' PIL backend of CLIPImageProcessor, bit for bit.

The reference is ``AutoImageProcessor.from_pretrained(dir, backend="pil")``, which in
transformers 5.x gives ``CLIPImageProcessorPil`` (the Pillow + numpy pipeline LLaVA was
trained with). Both sides read the same ``preprocessor_config.json``: the tiny llava-hf
checkpoints from conftest (56 px with center crop; 56x56 fixed resize without) and a
LLaVA-1.5 style config (shortest edge 336, crop 336, CLIP mean/std, bicubic). The last
test pins the claim in docs/preprocessing.md that the default torchvision backend
differs, by a uint8 level or two.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoProcessor
from transformers.utils import is_torchvision_available

from mm_serve.media.image_processor import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ImageProcessor
from tests.factories import gradient_image, image_in_mode

SIZES: list[tuple[int, int]] = [
    (5, 5), (13, 7), (56, 56), (57, 55), (100, 1), (1, 100), (223, 224),
    (336, 336), (640, 480), (480, 640), (1000, 300), (300, 1000),
]  # fmt: skip
"""(width, height) pairs: tiny, odd, exact-crop, off-by-one, 1-px strips, 4:3, 10:3."""
CHECKPOINTS = ("tiny_llava", "tiny_llava_multilayer", "llava15_config")
MODES = ("RGB", "RGBA", "L")
ONE_LEVEL = 1 / 255 / min(OPENAI_CLIP_STD)  # one uint8 step after normalization (~0.0150)

LLAVA15_PREPROCESSOR_CONFIG: dict[str, Any] = {
    "image_processor_type": "CLIPImageProcessor",
    "processor_class": "LlavaProcessor",
    "do_resize": True,
    "size": {"shortest_edge": 336},
    "resample": 3,
    "do_center_crop": True,
    "crop_size": {"height": 336, "width": 336},
    "do_rescale": True,
    "rescale_factor": 0.00392156862745098,
    "do_normalize": True,
    "image_mean": list(OPENAI_CLIP_MEAN),
    "image_std": list(OPENAI_CLIP_STD),
    "do_convert_rgb": True,
}

Pair = tuple[ImageProcessor, Callable[[list[Image.Image]], torch.Tensor]]


@pytest.fixture(scope="module")
def llava15_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding only a llava-1.5-7b-hf style preprocessor_config.json."""
    out = tmp_path_factory.mktemp("llava15_config")
    (out / "preprocessor_config.json").write_text(json.dumps(LLAVA15_PREPROCESSOR_CONFIG))
    return out


def pil_reference(model_dir: Path) -> Callable[[list[Image.Image]], torch.Tensor]:
    """transformers' PIL-backend CLIP processor for ``model_dir``, as a batch -> tensor call."""
    reference = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    # An unavailable backend falls back silently to the other one; make sure it did not.
    assert type(reference).__name__ == "CLIPImageProcessorPil" and reference.backend == "pil"
    return lambda images: reference(images=images, return_tensors="pt")["pixel_values"]


@pytest.fixture(scope="module")
def processors(request: pytest.FixtureRequest) -> Callable[[str], Pair]:
    """checkpoint fixture name -> (our processor, PIL reference), each loaded once."""
    cache: dict[str, Pair] = {}

    def get(name: str) -> Pair:
        if name not in cache:
            model_dir = request.getfixturevalue(name)
            cache[name] = (ImageProcessor.from_pretrained(model_dir), pil_reference(model_dir))
        return cache[name]

    return get


def make_image(mode: str, width: int, height: int) -> Image.Image:
    if mode == "RGB":
        return gradient_image(width, height, seed=width * 1009 + height)
    return image_in_mode(mode, width, height, seed=width + height)  # RGBA: alpha ramp 0-255


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("width", "height"), SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_equals_transformers_pil_backend(
    processors: Callable[[str], Pair], checkpoint: str, width: int, height: int, mode: str
) -> None:
    ours, reference = processors(checkpoint)
    image = make_image(mode, width, height)
    assert image.mode == mode
    got, want = ours([image]), reference([image])
    assert got.dtype == want.dtype == torch.float32
    assert got.shape == want.shape == (1, 3, *ours.output_size)  # type: ignore[misc]
    assert torch.equal(got, want), f"max abs difference {(got - want).abs().max().item()}"


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_batch_equals_transformers_pil_backend(
    processors: Callable[[str], Pair], checkpoint: str
) -> None:
    ours, reference = processors(checkpoint)
    images = [make_image(MODES[i % len(MODES)], w, h) for i, (w, h) in enumerate(SIZES)]
    got, want = ours(images), reference(images)
    assert got.shape == (len(SIZES), 3, *ours.output_size)  # type: ignore[misc]
    assert torch.equal(got, want)


def test_auto_processor_of_a_llava_checkpoint_uses_the_same_reference(tiny_llava: Path) -> None:
    # What a user loading the whole llava-hf processor gets with backend="pil".
    processor = AutoProcessor.from_pretrained(tiny_llava, backend="pil")
    assert type(processor.image_processor).__name__ == "CLIPImageProcessorPil"
    image = gradient_image(640, 480)
    want = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    assert torch.equal(ImageProcessor.from_pretrained(tiny_llava)([image]), want)


def test_torchvision_backend_differs_by_a_level_or_two(
    processors: Callable[[str], Pair], llava15_config: Path
) -> None:
    # Why we match the PIL backend, not transformers' default: the torchvision bicubic
    # rounds differently, moving some pixels by one uint8 level (two on upscaled tiny
    # images), which is enough to flip greedy tokens.
    if not is_torchvision_available():
        pytest.skip("torchvision is not installed; transformers has only the PIL backend")
    default = AutoImageProcessor.from_pretrained(llava15_config)
    if default.backend != "torchvision":
        pytest.skip(f"the default backend here is {default.backend!r}, not torchvision")
    ours, reference = processors("llava15_config")
    largest = 0.0
    for width, height in [(640, 480), (57, 55), (5, 5)]:
        image = gradient_image(width, height)
        fast = default(images=[image], return_tensors="pt")["pixel_values"]
        assert torch.equal(ours([image]), reference([image]))
        difference = (fast - reference([image])).abs()
        assert difference.max().item() <= 2 * ONE_LEVEL + 1e-5
        assert difference.mean().item() < 2e-3
        largest = max(largest, difference.max().item())
    assert largest > 0.5 * ONE_LEVEL  # the backends really disagree somewhere
