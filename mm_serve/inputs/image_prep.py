"""Images to model inputs, per family: the pixels, each image's tiles and original size, and the
image tokens each placeholder expands to.

* :class:`FixedSizeImages` (LLaVA-1.5 style): one preprocessed ``[3, H, W]`` per image
  (:class:`~mm_serve.media.image_processor.ImageProcessor`), the same token count for every image.
* :class:`AnyResImages` (LLaVA-NeXT, LLaVA-OneVision): transformers' own image processor of the
  family (``LlavaNextImageProcessorPil``, ``LlavaOnevisionImageProcessorPil``) tiles each image at its
  best resolution (the whole image, then its grid); the tokens each image makes follow from its size
  (:func:`~mm_serve.models.llava_next.anyres.num_image_tokens`). OneVision's images that share a
  prompt are one square-padded tile each, as its processor makes them.
* :class:`DynamicResolutionImages` (Qwen2-VL): each image resized to its own patch grid within the
  checkpoint's pixel bounds; its tokens are its merged patches. A video is one more such image whose
  grid has several temporal patches (``temporal_patch_size`` frames each), by transformers'
  ``Qwen2VLVideoProcessor``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from mm_serve.media.errors import ImageError
from mm_serve.media.image_loading import to_rgb
from mm_serve.media.image_processor import ImageProcessor
from mm_serve.media.video_loading import Video, VideoError
from mm_serve.models.llava_next.anyres import num_image_tokens
from mm_serve.models.model_config import VisionConfig


@dataclass
class PreparedImages:
    """The images of one request, ready for the tower."""

    pixel_values: torch.Tensor  # [N, 3, H, W], or every image's tiles [sum(tiles), 3, H, W]
    token_counts: list[int]  # image tokens each image makes, in order
    tiles: list[int] = field(default_factory=list)  # rows of pixel_values per image ([]: one each)
    sizes: list[tuple[int, ...]] = field(default_factory=list)  # original (height, width), or a patch grid
    second_per_grid: list[float] = field(default_factory=list)  # per image, seconds a temporal patch spans (0: a still)


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


# transformers' image processor of each any-resolution family (its PIL backend: no torchvision needed)
PROCESSORS = {"llava_next": "LlavaNextImageProcessorPil", "llava_onevision": "LlavaOnevisionImageProcessorPil"}


class AnyResImages:
    """Any-resolution tiling by transformers' image processor of the family (the checkpoint's
    ``preprocessor_config.json``), tokens by the model's pinpoints.

    Raises (construction):
        ValueError: a family without an any-resolution processor.
    """

    def __init__(self, model_dir: str | Path, family: str, vision: VisionConfig) -> None:
        import transformers

        if family not in PROCESSORS:
            raise ValueError(f"no any-resolution image processor for {family!r} (only {', '.join(PROCESSORS)})")
        self.processor = getattr(transformers, PROCESSORS[family]).from_pretrained(str(model_dir))
        self.vision = vision
        drop_first = vision.select_strategy == "default"
        # one tile alone: its positions (and class token) less the first under ``default``, and a newline
        self.one_tile_tokens = (vision.image_size // vision.patch_size) ** 2 + vision.class_token - drop_first + 1

    def __call__(self, images: Sequence[Image.Image], details: Sequence[str | None] = ()) -> PreparedImages:
        """Each image processed alone (no padding to another image's tile count). ``details[i]`` ``low``
        keeps only the whole-image tile: its features and one newline (OpenAI's low detail: fewer tokens,
        faster); ``high`` or ``auto`` the full tiling. OneVision: two or more images, one tile each."""
        if len(images) > 1 and self.vision.multi_image_untiled:
            rgbs = [to_rgb(image) for image in images]
            batch = _run(self.processor, 0, rgbs[0], images=[rgbs], return_tensors="pt")["pixel_values"][:, 0]  # [N, 3, H, W]
            return PreparedImages(batch, [self.one_tile_tokens] * len(rgbs), [1] * len(rgbs),
                                  [(int(rgb.height), int(rgb.width)) for rgb in rgbs])
        vision = self.vision
        drop_first = vision.select_strategy == "default"
        pixels: list[torch.Tensor] = []
        tiles: list[int] = []
        sizes: list[tuple[int, ...]] = []
        counts: list[int] = []
        for i, image in enumerate(images):
            rgb = to_rgb(image)
            tiled = _run(self.processor, i, rgb, images=[rgb], return_tensors="pt")["pixel_values"][0]  # [tiles, 3, H, W]
            size = (int(rgb.height), int(rgb.width))
            low = i < len(details) and details[i] == "low"
            pixels.append(tiled[:1] if low else tiled)
            tiles.append(1 if low else int(tiled.shape[0]))
            sizes.append(size)
            counts.append(self.one_tile_tokens if low else num_image_tokens(
                size, vision.grid_pinpoints, vision.image_size, vision.patch_size, vision.class_token, drop_first,
                vision.max_num_patches))
        return PreparedImages(torch.cat(pixels, dim=0), counts, tiles, sizes)


def _run(processor: Any, index: int, image: Image.Image | Video, **kwargs: Any) -> Any:
    """``processor(**kwargs)``, its refusal of an image (transformers raises ValueError, e.g. Qwen2-VL's
    for an aspect ratio over 200) as an :class:`ImageError` naming the image (a 400, not a 500).

    Raises:
        ImageError: the processor cannot take the image.
    """
    try:
        return processor(**kwargs)
    except (ValueError, RuntimeError) as exc:
        if isinstance(image, Video):
            raise VideoError(f"a video ({image.num_frames} frames of {image.size[1]}x{image.size[0]} px) cannot be "
                             f"preprocessed for this model: {str(exc)[:200]}") from None
        raise ImageError(f"image {index + 1} ({image.width}x{image.height} px) cannot be preprocessed for this model: "
                         f"{str(exc)[:200]}") from None


LOW_DETAIL_PIXELS = 512 * 512  # OpenAI's low detail: a 512 x 512 image's worth


class DynamicResolutionImages:
    """Qwen2-VL: transformers' ``Qwen2VLImageProcessorPil`` (the checkpoint's ``preprocessor_config.json``)
    resizes each image to whole merged patches within the pixel bounds and cuts it into patches; the
    image makes one token per ``merge x merge`` patches. A :class:`~mm_serve.media.video_loading.Video` goes
    through ``Qwen2VLVideoProcessor`` (``video_preprocessor_config.json``, else the image processor's file):
    every frame resized alike within the video processor's bounds, frames grouped ``temporal_patch_size``
    at a time (the last repeated to fill a group), one token per ``merge x merge`` patches of a group.
    """

    def __init__(self, model_dir: str | Path, vision: VisionConfig) -> None:
        import transformers

        self.model_dir = str(model_dir)
        self.processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(self.model_dir)
        self.vision = vision
        self._video_processor: Any = None

    @property
    def video_processor(self) -> Any:
        """The checkpoint's ``Qwen2VLVideoProcessor``, loaded on first use."""
        if self._video_processor is None:
            import transformers

            processor = transformers.Qwen2VLVideoProcessor.from_pretrained(self.model_dir)
            if processor.cap_pixels_per_frame is None:  # a checkpoint that predates the option: the reference's cap
                processor.cap_pixels_per_frame = True
            self._video_processor = processor
        return self._video_processor

    def __call__(self, images: Sequence[Image.Image | Video], details: Sequence[str | None] = (),
                 pixel_bounds: tuple[int, int] | None = None) -> PreparedImages:
        """Each image alone: its patches ``[t*h*w, C*T*P*P]`` (``tiles``: ``t*h*w`` each) and its grid ``(h, w)``
        in patches (``sizes``; a video's ``(t, h, w)``, ``t`` its temporal patches, with the seconds one spans in
        ``second_per_grid``), an image resized within ``pixel_bounds`` (min, max pixels; default the
        checkpoint's, which the caller has checked these lie within). ``details[i]`` ``low`` caps an image at a
        512 x 512 image's pixels (not below the minimum); ``high`` and ``auto`` leave the maximum.

        Raises:
            ImageError: an image or video the processor cannot take."""
        floor, ceiling = pixel_bounds or self.vision.pixel_bounds
        pixels: list[torch.Tensor] = []
        tiles: list[int] = []
        grids: list[tuple[int, ...]] = []
        counts: list[int] = []
        seconds: list[float] = []
        for i, image in enumerate(images):
            if isinstance(image, Video):
                out = _run(self.video_processor, i, image, videos=[image.frames], do_sample_frames=False,
                           return_tensors="pt")
                t, h, w = (int(v) for v in out["video_grid_thw"][0])
                pixels.append(out["pixel_values_videos"])
                grids.append((t, h, w))
                seconds.append(self.vision.temporal_patch_size / image.fps)
            else:
                top = max(floor, min(ceiling, LOW_DETAIL_PIXELS)) if i < len(details) and details[i] == "low" else ceiling
                kwargs: dict[str, Any] = {} if (floor, top) == self.vision.pixel_bounds else {
                    "size": {"shortest_edge": floor, "longest_edge": top}}
                out = _run(self.processor, i, image, images=[to_rgb(image)], return_tensors="pt", **kwargs)
                t, h, w = (int(v) for v in out["image_grid_thw"][0])
                pixels.append(out["pixel_values"])
                grids.append((h, w))
                seconds.append(0.0)
            tiles.append(t * h * w)
            counts.append(t * h * w // self.vision.merge_size**2)
        return PreparedImages(torch.cat(pixels, dim=0), counts, tiles, grids,
                              seconds if any(seconds) else [])


def image_prep(model_dir: str | Path, family: str, vision: VisionConfig
               ) -> FixedSizeImages | AnyResImages | DynamicResolutionImages:
    """The image preparation of a checkpoint of ``family`` (``ModelConfig.model_type``) with ``vision``.

    Raises:
        ValueError: an any-resolution ``vision`` of a family without a processor for it.
    """
    if vision.dynamic_resolution:
        return DynamicResolutionImages(model_dir, vision)
    return AnyResImages(model_dir, family, vision) if vision.any_resolution else FixedSizeImages(model_dir, vision)
