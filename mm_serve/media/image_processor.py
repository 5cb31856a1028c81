"""CLIP-style image preprocessing (resize, center crop, rescale, normalize) in Pillow + numpy.

Follows the arithmetic of transformers' PIL image processor (``CLIPImageProcessorPil``
in transformers 5.x) step for step: Pillow ``resize`` with the checkpoint's filter,
a center crop that zero-pads images smaller than the crop, ``uint8 -> float64 *
rescale_factor -> float32``, then ``(x - mean) / std`` in float32. On ordinary
images the result matches transformers exactly (tests allow 1e-5).

Extreme aspect ratios: a shortest-edge resize of a 1xN strip would make the long
side ``size * N`` pixels (gigabytes). When the resized long side would exceed
``4 * max(crop)`` pixels, the source is first cropped to the band the center crop
keeps, plus a margin for the filter's support, and only that band is resampled
(horizontal pass, then vertical, at the scale of the full resize, as Pillow does).
Outputs for such images may differ from transformers by a uint8 level or two in
rare pixels (Pillow's float32 box arithmetic); tests bound the difference.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from mm_serve.media.image_loading import to_rgb

OPENAI_CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
PREPROCESSOR_CONFIG_NAME = "preprocessor_config.json"
_EXTREME_RESIZE_FACTOR = 4
_MAX_FILTER_SUPPORT = 3.0
_CONFIG_KEYS = (
    "do_resize", "size", "resample", "do_center_crop", "crop_size", "do_rescale",
    "rescale_factor", "do_normalize", "image_mean", "image_std", "do_convert_rgb",
)  # fmt: skip


# Defaults of transformers' image processors this class reproduces, for keys a config leaves out
PROCESSOR_DEFAULTS: dict[str, dict[str, Any]] = {
    "CLIPImageProcessor": {},
    # SiglipImageProcessor: a square bicubic resize, no crop, mean and std 0.5
    "SiglipImageProcessor": {"size": {"height": 224, "width": 224}, "do_center_crop": False,
                             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
}


class ImageProcessor:
    """Turns PIL images into normalized pixel tensors for a CLIP-style vision tower.

    The processor only makes pixel tensors; the number of image tokens is the
    vision encoder's business. Every image is first converted with
    :func:`~mm_serve.media.image_loading.to_rgb` (EXIF orientation, alpha onto
    white); ``do_convert_rgb`` is accepted for config compatibility but the output
    always has 3 channels.

    Args:
        do_resize: resize before cropping.
        size: ``{"shortest_edge": S}`` (keep the aspect ratio, short side -> S,
            long side -> ``int(S * long / short)``), ``{"height": H, "width": W}``,
            or an int meaning ``{"shortest_edge": int}`` (old CLIP configs).
            Default ``{"shortest_edge": 224}``.
        resample: Pillow filter number (0 nearest, 1 lanczos, 2 bilinear,
            3 bicubic, 4 box, 5 hamming).
        do_center_crop: center crop to ``crop_size``, zero-padding smaller images.
        crop_size: ``{"height": H, "width": W}`` or an int for a square.
            Default 224x224.
        do_rescale: multiply uint8 values by ``rescale_factor``.
        rescale_factor: typically 1/255.
        do_normalize: apply ``(x - image_mean) / image_std`` per channel.
        image_mean: per-channel (R, G, B) mean, or one value for all channels.
        image_std: per-channel (R, G, B) std (positive), or one value.
        do_convert_rgb: ignored; see above.

    Raises:
        ValueError: a config value is missing, malformed or out of range.
    """

    def __init__(
        self,
        *,
        do_resize: bool = True,
        size: Mapping[str, int] | int | None = None,
        resample: int = int(Image.Resampling.BICUBIC),
        do_center_crop: bool = True,
        crop_size: Mapping[str, int] | int | None = None,
        do_rescale: bool = True,
        rescale_factor: float = 1 / 255,
        do_normalize: bool = True,
        image_mean: Sequence[float] | float = OPENAI_CLIP_MEAN,
        image_std: Sequence[float] | float = OPENAI_CLIP_STD,
        do_convert_rgb: bool = True,
    ) -> None:
        self.do_resize = do_resize
        self.shortest_edge, self.resize_hw = _parse_size(
            {"shortest_edge": 224} if size is None else size
        )
        if resample not in range(6):
            raise ValueError(f"resample must be a Pillow filter number 0-5, got {resample!r}")
        self.resample = Image.Resampling(resample)
        self.do_center_crop = do_center_crop
        self.crop_hw = _parse_crop_size(224 if crop_size is None else crop_size)
        self.do_rescale = do_rescale
        if not math.isfinite(rescale_factor):
            raise ValueError(f"rescale_factor must be finite, got {rescale_factor!r}")
        self.rescale_factor = float(rescale_factor)
        self.do_normalize = do_normalize
        self.image_mean = _per_channel("image_mean", image_mean)
        self.image_std = _per_channel("image_std", image_std)
        if not np.all(self.image_std > 0):
            raise ValueError(f"image_std must be positive, got {image_std!r}")
        self.do_convert_rgb = do_convert_rgb

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ImageProcessor:
        """Build from a ``preprocessor_config.json`` dict; unknown keys are ignored, and keys it leaves
        out take the defaults of the transformers class its ``image_processor_type`` names
        (:data:`PROCESSOR_DEFAULTS`; CLIP's otherwise).

        Raises:
            ValueError: an ``image_processor_type`` that is not CLIP-style preprocessing.
        """
        kind = str(config.get("image_processor_type", "CLIPImageProcessor")).removesuffix("Fast").removesuffix("Pil")
        if kind not in PROCESSOR_DEFAULTS:
            raise ValueError(f"image_processor_type {kind!r} is not supported ({', '.join(PROCESSOR_DEFAULTS)})")
        given = {key: config[key] for key in _CONFIG_KEYS if key in config}
        return cls(**{**PROCESSOR_DEFAULTS[kind], **given})

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str]) -> ImageProcessor:
        """Build from ``<model_dir>/preprocessor_config.json``.

        Raises:
            FileNotFoundError: the checkpoint has no preprocessor config.
            ValueError: the config is not valid JSON or has bad values.
        """
        path = os.path.join(model_dir, PREPROCESSOR_CONFIG_NAME)
        with open(path, encoding="utf-8") as handle:
            return cls.from_dict(json.load(handle))

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every output image, or None when it depends on the input."""
        if self.do_center_crop:
            return self.crop_hw
        if self.do_resize and self.resize_hw is not None:
            return self.resize_hw
        return None

    def __call__(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """Preprocess a batch.

        Args:
            images: PIL images of any mode and size (at least 1x1).

        Returns:
            float32 tensor ``[num_images, 3, H, W]``, (H, W) = :attr:`output_size`.

        Raises:
            ValueError: the images preprocess to different sizes (possible only
                without a center crop or fixed resize), or the batch is empty and
                :attr:`output_size` is None.
        """
        if not images:
            if self.output_size is None:
                raise ValueError("cannot infer the output size of an empty batch")
            return torch.empty((0, 3, *self.output_size), dtype=torch.float32)
        arrays = [self.preprocess_one(image) for image in images]
        shapes = {array.shape for array in arrays}
        if len(shapes) > 1:
            raise ValueError(f"images preprocess to different sizes {sorted(shapes)}; cannot batch")
        return torch.from_numpy(np.stack(arrays))

    def preprocess_one(self, image: Image.Image) -> np.ndarray:
        """Preprocess one image to a float32 array ``[3, H, W]`` (see :meth:`__call__`)."""
        pixels = self._resize_and_crop(to_rgb(image)).transpose(2, 0, 1)
        if self.do_rescale:
            values = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        else:
            values = pixels.astype(np.float32)
        if self.do_normalize:
            values = (values - self.image_mean[:, None, None]) / self.image_std[:, None, None]
        return np.ascontiguousarray(values, dtype=np.float32)

    def _resize_and_crop(self, image: Image.Image) -> np.ndarray:
        """Resize then center crop an RGB image; returns uint8 ``[H, W, 3]``."""
        if self.do_resize:
            height, width = self._resized_hw(image.width, image.height)
            limit = _EXTREME_RESIZE_FACTOR * max(self.crop_hw)
            if self.do_center_crop and max(height, width) > limit:
                return self._resize_cropped_region(image, height, width)
            image = image.resize((width, height), self.resample)
        pixels = np.asarray(image)
        if not self.do_center_crop:
            return pixels
        (top, rows, pad_top), (left, cols, pad_left) = (
            _crop_window(pixels.shape[0], self.crop_hw[0]),
            _crop_window(pixels.shape[1], self.crop_hw[1]),
        )
        return self._on_canvas(pixels[top : top + rows, left : left + cols], pad_top, pad_left)

    def _on_canvas(self, region: np.ndarray, pad_top: int, pad_left: int) -> np.ndarray:
        """Place a cropped uint8 ``[h, w, 3]`` region on a black canvas of the crop size."""
        if region.shape[:2] == self.crop_hw:
            return region
        canvas = np.zeros((*self.crop_hw, 3), dtype=np.uint8)
        canvas[pad_top : pad_top + region.shape[0], pad_left : pad_left + region.shape[1]] = region
        return canvas

    def _resized_hw(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) after the resize step, as transformers computes it."""
        if self.resize_hw is not None:
            return self.resize_hw
        assert self.shortest_edge is not None  # _parse_size sets exactly one of the two
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def _resize_cropped_region(self, image: Image.Image, height: int, width: int) -> np.ndarray:
        """Resample only the part of a (height x width) resize that the center crop keeps.

        Reproduces Pillow's full resize: horizontal pass, then vertical pass (the order
        Pillow uses when both axes scale alike), each on a source band that covers the
        kept region plus the filter's support. Only Pillow's float32 box arithmetic
        differs, which can move a rare pixel by a uint8 level or two.
        """
        top, rows, pad_top = _crop_window(height, self.crop_hw[0])
        left, cols, pad_left = _crop_window(width, self.crop_hw[1])
        scale_x, scale_y = image.width / width, image.height / height  # source px per output px
        x0, x1 = _source_band(left, cols, scale_x, image.width)
        y0, y1 = _source_band(top, rows, scale_y, image.height)
        band = image.crop((x0, y0, x1, y1))
        x_box = (left * scale_x - x0, 0, (left + cols) * scale_x - x0, band.height)
        band = band.resize((cols, band.height), self.resample, box=x_box)
        y_box = (0, top * scale_y - y0, cols, (top + rows) * scale_y - y0)
        band = band.resize((cols, rows), self.resample, box=y_box)
        return self._on_canvas(np.asarray(band), pad_top, pad_left)


def _source_band(start: int, length: int, scale: float, source_size: int) -> tuple[int, int]:
    """Source pixel range [lo, hi) that output pixels [start, start + length) read.

    ``scale`` is source pixels per output pixel; the margin covers the widest
    Pillow filter (Lanczos, support 3) stretched by the downscale factor.
    """
    margin = _MAX_FILTER_SUPPORT * max(scale, 1.0) + 1
    lo = max(0, math.floor(start * scale - margin))
    hi = min(source_size, math.ceil((start + length) * scale + margin))
    return lo, hi


def _crop_window(size: int, crop: int) -> tuple[int, int, int]:
    """Center-crop one axis: (source start, kept length, zero-padding before).

    An axis longer than the crop keeps ``crop`` pixels from ``(size - crop) // 2``;
    a shorter one keeps all and is padded by ``ceil((crop - size) / 2)`` before.
    """
    if size >= crop:
        return (size - crop) // 2, crop, 0
    return 0, size, (crop - size + 1) // 2


def _parse_size(size: Mapping[str, int] | int) -> tuple[int | None, tuple[int, int] | None]:
    """Return (shortest_edge, None) or (None, (height, width)) for a ``size`` config."""
    if isinstance(size, int):
        return _positive("size", size), None
    if set(size) == {"shortest_edge"}:
        return _positive("size.shortest_edge", size["shortest_edge"]), None
    if set(size) == {"height", "width"}:
        return None, (
            _positive("size.height", size["height"]),
            _positive("size.width", size["width"]),
        )
    raise ValueError(
        f'size must be {{"shortest_edge": S}} or {{"height": H, "width": W}}, got {size!r}'
    )


def _parse_crop_size(crop_size: Mapping[str, int] | int) -> tuple[int, int]:
    """Return (height, width) for a ``crop_size`` config (an int means a square)."""
    if isinstance(crop_size, int):
        side = _positive("crop_size", crop_size)
        return side, side
    if set(crop_size) == {"height", "width"}:
        return _positive("crop_size.height", crop_size["height"]), _positive(
            "crop_size.width", crop_size["width"]
        )
    raise ValueError(f'crop_size must be {{"height": H, "width": W}} or an int, got {crop_size!r}')


def _positive(name: str, value: Any) -> int:
    """Check that a size value is a positive int (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _per_channel(name: str, value: Sequence[float] | float) -> np.ndarray:
    """A float32 array of 3 per-channel values; a single number is repeated."""
    values = [float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != 3 or not all(math.isfinite(v) for v in values):
        raise ValueError(f"{name} must be 3 finite numbers (R, G, B), got {value!r}")
    return np.array(values, dtype=np.float32)
