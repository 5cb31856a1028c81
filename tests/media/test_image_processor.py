"""Tests for mm_serve.media.image_processor, golden against transformers' CLIP image processors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import CLIPImageProcessor, CLIPImageProcessorPil

from mm_serve.media.image_processor import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ImageProcessor

LLAVA_CONFIG: dict[str, Any] = {
    "size": {"shortest_edge": 336},
    "crop_size": {"height": 336, "width": 336},
}
NO_CROP_CONFIG: dict[str, Any] = {"size": {"height": 64, "width": 64}, "do_center_crop": False}
ONE_LEVEL = 1 / 255 / min(OPENAI_CLIP_STD)  # one uint8 step after normalization (~0.0146)


def make_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A horizontal gradient plus noise: structure for the filters, no flat regions."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, width)[None, :, None] * np.ones((height, 1, 3))
    pixels = np.clip(ramp + rng.normal(0, 40, (height, width, 3)), 0, 255)
    return Image.fromarray(pixels.astype(np.uint8))


def reference(config: dict[str, Any], image: Image.Image) -> np.ndarray:
    processor = CLIPImageProcessorPil(**config)
    assert processor.backend == "pil"  # the PIL/numpy implementation, not torchvision
    return processor(images=[image], return_tensors="np")["pixel_values"]


def expected_constant(rgb: tuple[int, int, int]) -> np.ndarray:
    """Normalized value of a uniform colour, per channel."""
    return (np.array(rgb) / 255 - np.array(OPENAI_CLIP_MEAN)) / np.array(OPENAI_CLIP_STD)


@pytest.mark.parametrize(
    ("width", "height"),
    [(640, 480), (480, 640), (336, 336), (1000, 333), (333, 1000), (37, 91), (5, 7), (1, 1)],
)
def test_matches_transformers_with_llava_config(width: int, height: int) -> None:
    image = make_image(width, height)
    ours = ImageProcessor(**LLAVA_CONFIG)([image])
    assert ours.shape == (1, 3, 336, 336) and ours.dtype == torch.float32
    np.testing.assert_allclose(ours.numpy(), reference(LLAVA_CONFIG, image), rtol=0, atol=1e-5)


@pytest.mark.parametrize(("width", "height"), [(640, 480), (1, 1), (3, 500), (500, 3), (64, 64)])
def test_matches_transformers_with_fixed_size_no_crop(width: int, height: int) -> None:
    image = make_image(width, height)
    ours = ImageProcessor(**NO_CROP_CONFIG)([image])
    assert ours.shape == (1, 3, 64, 64)
    np.testing.assert_allclose(ours.numpy(), reference(NO_CROP_CONFIG, image), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "config",
    [
        {"size": {"shortest_edge": 200}, "crop_size": {"height": 224, "width": 256}},  # zero pads
        {"size": 224, "crop_size": 224, "resample": 2},  # old int sizes, bilinear
        {"size": {"shortest_edge": 96}, "do_normalize": False, "crop_size": 80},
    ],
)
def test_matches_transformers_with_other_configs(config: dict[str, Any]) -> None:
    for width, height in [(300, 200), (150, 400)]:
        image = make_image(width, height, seed=width)
        ours = ImageProcessor(**config)([image]).numpy()
        np.testing.assert_allclose(ours, reference(config, image), rtol=0, atol=1e-5)


@pytest.mark.parametrize(("width", "height"), [(3, 500), (500, 101), (60, 1000)])
def test_extreme_aspect_ratios_stay_close_to_transformers(width: int, height: int) -> None:
    # These take the crop-before-resize path; transformers materializes the full resize.
    image = make_image(width, height)
    difference = np.abs(
        ImageProcessor(**LLAVA_CONFIG)([image]).numpy() - reference(LLAVA_CONFIG, image)
    )
    assert difference.max() <= 2 * ONE_LEVEL + 1e-5
    assert difference.mean() < 1e-3


def test_close_to_transformers_torchvision_processor() -> None:
    # transformers' default CLIPImageProcessor is the torchvision backend; its bicubic
    # differs from Pillow's by at most about one uint8 level on ordinary images.
    image = make_image(640, 480)
    fast = CLIPImageProcessor(**LLAVA_CONFIG)(images=[image], return_tensors="pt")["pixel_values"]
    difference = (ImageProcessor(**LLAVA_CONFIG)([image]) - fast).abs()
    assert difference.max().item() <= 2 * ONE_LEVEL and difference.mean().item() < 1e-3


@pytest.mark.parametrize(
    ("width", "height"), [(1, 100_000), (100_000, 1), (1, 1), (3, 7), (10_000, 10_000)]
)
def test_extreme_sizes_give_the_crop_shape_and_exact_values(width: int, height: int) -> None:
    colour = (10, 200, 30)
    image = Image.new("RGB", (width, height), colour)
    for config, size in ((LLAVA_CONFIG, 336), (NO_CROP_CONFIG, 64)):
        pixels = ImageProcessor(**config)([image])
        assert pixels.shape == (1, 3, size, size)
        assert torch.isfinite(pixels).all()
        expected = expected_constant(colour)[:, None, None]
        np.testing.assert_allclose(
            pixels[0].numpy(), np.broadcast_to(expected, (3, size, size)), atol=1e-5
        )


def test_strip_keeps_its_centre() -> None:
    # A 1 x 4000 strip, black except 100 white pixels in the middle: the crop keeps
    # the middle 336 / (336 * 4000) of the resized strip, i.e. only white.
    pixels = np.zeros((4000, 1, 3), dtype=np.uint8)
    pixels[1950:2050] = 255
    out = ImageProcessor(**LLAVA_CONFIG)([Image.fromarray(pixels)])
    np.testing.assert_allclose(
        out[0, :, 168, 168].numpy(), expected_constant((255, 255, 255)), atol=1e-5
    )
    assert torch.allclose(out[0], out[0, :, :1, :1].expand(3, 336, 336))


def test_modes_are_converted_first() -> None:
    transparent = Image.new("RGBA", (40, 30), (255, 0, 0, 0))
    grey16 = Image.new("I;16", (40, 30), 65535)
    out = ImageProcessor(**LLAVA_CONFIG)([transparent, grey16])
    assert out.shape == (2, 3, 336, 336)
    white = torch.tensor(expected_constant((255, 255, 255)), dtype=torch.float32)
    assert torch.allclose(out, white[None, :, None, None].expand_as(out), atol=1e-5)


def test_batch_shapes() -> None:
    processor = ImageProcessor(**LLAVA_CONFIG)
    batch = processor([make_image(50, 80), make_image(90, 20)])
    assert batch.shape == (2, 3, 336, 336) and batch.is_contiguous()
    assert processor([]).shape == (0, 3, 336, 336)
    varying = ImageProcessor(size={"shortest_edge": 32}, do_center_crop=False)
    assert varying.output_size is None
    with pytest.raises(ValueError, match="different sizes"):
        varying([make_image(32, 64), make_image(64, 32)])
    with pytest.raises(ValueError, match="empty batch"):
        varying([])


def test_from_pretrained_reads_a_llava_preprocessor_config(tmp_path: Path) -> None:
    config = {
        **LLAVA_CONFIG,
        "do_center_crop": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": list(OPENAI_CLIP_MEAN),
        "image_std": list(OPENAI_CLIP_STD),
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    processor = ImageProcessor.from_pretrained(tmp_path)
    assert (processor.shortest_edge, processor.crop_hw, processor.output_size) == (
        336,
        (336, 336),
        (336, 336),
    )
    image = make_image(400, 300)
    golden = CLIPImageProcessorPil.from_pretrained(tmp_path)(images=[image], return_tensors="np")
    np.testing.assert_allclose(processor([image]).numpy(), golden["pixel_values"], atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"size": {"longest_edge": 5}}, "size must be"),
        ({"size": {"shortest_edge": 0}}, "positive integer"),
        ({"crop_size": {"height": 3}}, "crop_size must be"),
        ({"resample": 9}, "resample"),
        ({"image_std": [0.0, 1.0, 1.0]}, "image_std must be positive"),
        ({"image_mean": [0.5, 0.5]}, "3 finite numbers"),
        ({"rescale_factor": float("nan")}, "rescale_factor"),
    ],
)
def test_bad_config_values_are_rejected(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ImageProcessor(**kwargs)
