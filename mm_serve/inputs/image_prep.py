"""Images to model inputs, per family: the pixels, each image's tiles and original size, and the
image tokens each placeholder expands to.

* :class:`FixedSizeImages` (LLaVA-1.5 style): one preprocessed ``[3, H, W]`` per image
  (:class:`~mm_serve.media.image_processor.ImageProcessor`), the same token count for every image.
* :class:`AnyResImages` (LLaVA-NeXT): transformers' own ``LlavaNextImageProcessorPil`` tiles each
  image at its best resolution (the whole image, then its grid); the tokens each image makes follow
  from its size (:func:`~mm_serve.models.llava_next.anyres.num_image_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image

from mm_serve.media.image_loading import to_rgb
from mm_serve.media.image_processor import ImageProcessor
from mm_serve.models.llava_next.anyres import num_image_tokens
from mm_serve.models.model_config import VisionConfig


@dataclass
class PreparedImages:
    """The images of one request, ready for the tower."""

    pixel_values: torch.Tensor  # [N, 3, H, W], or every image's tiles [sum(tiles), 3, H, W]
    token_counts: list[int]  # image tokens each image makes, in order
    tiles: list[int] = field(default_factory=list)  # rows of pixel_values per image ([]: one each)
    sizes: list[tuple[int, int]] = field(default_factory=list)  # original (height, width), where features need it


class FixedSizeImages:
    """One ``[3, H, W]`` per image, ``vision.num_image_tokens`` tokens each."""

    def __init__(self, model_dir: str | Path, vision: VisionConfig) -> None:
        self.processor = ImageProcessor.from_pretrained(model_dir)
        self.tokens = vision.num_image_tokens

    def __call__(self, images: Sequence[Image.Image], details: Sequence[str | None] = ()) -> PreparedImages:
        """Every image alike (its ``details`` change nothing here).

        Raises:
            ImageError: an image that cannot be preprocessed."""
        return PreparedImages(self.processor(images), [self.tokens] * len(images))


class AnyResImages:
    """LLaVA-NeXT tiling by transformers' ``LlavaNextImageProcessorPil`` (the checkpoint's
    ``preprocessor_config.json``), tokens by the model's pinpoints."""

    def __init__(self, model_dir: str | Path, vision: VisionConfig) -> None:
        from transformers import LlavaNextImageProcessorPil

        self.processor = LlavaNextImageProcessorPil.from_pretrained(str(model_dir))
        self.vision = vision

    def __call__(self, images: Sequence[Image.Image], details: Sequence[str | None] = ()) -> PreparedImages:
        """Each image processed alone (no padding to another image's tile count). ``details[i]`` ``low``
        keeps only the whole-image tile: its features and one newline (OpenAI's low detail: fewer tokens,
        faster); ``high`` or ``auto`` the full tiling."""
        vision = self.vision
        drop_first = vision.select_strategy == "default"
        low_tokens = (vision.image_size // vision.patch_size) ** 2 + (1 if vision.class_token else 0) - drop_first + 1
        pixels, tiles, sizes, counts = [], [], [], []
        for i, image in enumerate(images):
            rgb = to_rgb(image)
            tiled = self.processor(images=[rgb], return_tensors="pt")["pixel_values"][0]  # [tiles, 3, H, W]
            size = (int(rgb.height), int(rgb.width))
            low = i < len(details) and details[i] == "low"
            pixels.append(tiled[:1] if low else tiled)
            tiles.append(1 if low else int(tiled.shape[0]))
            sizes.append(size)
            counts.append(low_tokens if low else num_image_tokens(size, vision.grid_pinpoints, vision.image_size,
                                                                  vision.patch_size, vision.class_token, drop_first))
        return PreparedImages(torch.cat(pixels, dim=0), counts, tiles, sizes)


def image_prep(model_dir: str | Path, vision: VisionConfig) -> FixedSizeImages | AnyResImages:
    """The image preparation of a checkpoint with ``vision``."""
    return AnyResImages(model_dir, vision) if vision.any_resolution else FixedSizeImages(model_dir, vision)
