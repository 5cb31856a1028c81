"""Scene generator: 1 to 3 non-overlapping coloured shapes drawn with Pillow.

A scene is a plain light background (a random light tone) with one to three
shapes from :data:`SHAPES` in colours from :data:`COLOURS`, each shape inside a
square bounding box of random size and position. The ground truth is returned
beside the image as a list of :class:`SceneObject`, sorted left to right by the
centre of the bounding box (the order the caption uses).

Invariants every scene satisfies (tests check them):

* image width and height are in ``[MIN_SIDE, MAX_SIDE]`` px and the aspect ratio
  (long side / short side) is at most ``max_aspect`` (3 by default, see
  :func:`sample_size`);
* bounding boxes are pairwise disjoint with at least ``GAP_PX`` px between them;
* the centres of any two boxes are at least ``MIN_CENTRE_SEPARATION`` of the image
  width apart horizontally, so "left to right" is never ambiguous.

Randomness comes only from the ``random.Random`` passed in; :func:`scene_rng`
derives one from a namespace, a seed and an index, so the training and
evaluation streams are disjoint by construction (different namespaces).
"""

from __future__ import annotations

import random
from typing import NamedTuple

from PIL import Image, ImageDraw

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 35, 35),
    "green": (35, 155, 55),
    "blue": (35, 75, 215),
    "yellow": (235, 200, 10),
    "purple": (135, 55, 175),
    "orange": (250, 130, 15),
}
"""Colour name → base RGB; each drawn shape jitters each channel by ±``COLOUR_JITTER``."""

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
MIN_SIDE = 48
MAX_SIDE = 512
GAP_PX = 2
MIN_CENTRE_SEPARATION = 0.1
COLOUR_JITTER = 12
_SIZE_RANGE = (0.2, 0.45)  # shape side as a fraction of the image's short side
_MIN_SHAPE_PX = 10
_PLACEMENT_TRIES = 60


class SceneObject(NamedTuple):
    """One drawn shape: colour name, shape name and bbox ``(x0, y0, x1, y1)`` in px (x1, y1 exclusive)."""

    colour: str
    shape: str
    bbox: tuple[int, int, int, int]

    @property
    def centre_x(self) -> float:
        """Horizontal centre of the bounding box, in px."""
        return (self.bbox[0] + self.bbox[2]) / 2


def scene_rng(namespace: str, seed: int, index: int) -> random.Random:
    """A generator for scene ``index`` of stream ``(namespace, seed)``; same arguments, same scenes."""
    return random.Random(f"mm-serve-shapes/{namespace}/{seed}/{index}")


def sample_size(rng: random.Random, max_aspect: float = 3.0) -> tuple[int, int]:
    """Draw ``(width, height)`` in px, each in ``[MIN_SIDE, MAX_SIDE]``, long/short side ≤ ``max_aspect``.

    The aspect ratio is bounded because the model squashes every image to a square
    before its vision tower: beyond about 3:1 a shape shrinks to a few pixels
    along the squashed axis. Pass explicit sizes to :func:`draw_scene` for more.
    """
    width = rng.randint(MIN_SIDE, MAX_SIDE)
    low = max(MIN_SIDE, int(width / max_aspect + 0.999))
    high = min(MAX_SIDE, int(width * max_aspect))
    return width, rng.randint(low, high)


def _fits(box: tuple[int, int, int, int], placed: list[SceneObject], width: int) -> bool:
    x0, y0, x1, y1 = box
    centre = (x0 + x1) / 2
    for other in placed:
        ox0, oy0, ox1, oy1 = other.bbox
        apart = x1 + GAP_PX <= ox0 or ox1 + GAP_PX <= x0 or y1 + GAP_PX <= oy0 or oy1 + GAP_PX <= y0
        if not apart or abs(centre - other.centre_x) < MIN_CENTRE_SEPARATION * width:
            return False
    return True


def _place(rng: random.Random, width: int, height: int, count: int) -> list[SceneObject]:
    """Place ``count`` shapes by rejection sampling, shrinking the size range until they fit."""
    scale = 1.0
    while True:
        placed: list[SceneObject] = []
        for _ in range(count):
            for _ in range(_PLACEMENT_TRIES):
                side = max(_MIN_SHAPE_PX, int(min(width, height) * scale * rng.uniform(*_SIZE_RANGE)))
                x0 = rng.randint(0, width - side)
                y0 = rng.randint(0, height - side)
                box = (x0, y0, x0 + side, y0 + side)
                if _fits(box, placed, width):
                    placed.append(SceneObject(rng.choice(list(COLOURS)), rng.choice(SHAPES), box))
                    break
            else:
                break
        if len(placed) == count:
            return sorted(placed, key=lambda obj: obj.centre_x)
        scale *= 0.85


def _jitter(rng: random.Random, rgb: tuple[int, int, int], amount: int) -> tuple[int, int, int]:
    r, g, b = (min(255, max(0, c + rng.randint(-amount, amount))) for c in rgb)
    return r, g, b


def _draw(draw: ImageDraw.ImageDraw, obj: SceneObject, fill: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = obj.bbox
    if obj.shape == "circle":
        draw.ellipse((x0, y0, x1 - 1, y1 - 1), fill=fill)
    elif obj.shape == "square":
        draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=fill)
    else:
        draw.polygon([((x0 + x1 - 1) / 2, y0), (x1 - 1, y1 - 1), (x0, y1 - 1)], fill=fill)


def draw_scene(
    rng: random.Random,
    size: tuple[int, int] | None = None,
    count: int | None = None,
) -> tuple[Image.Image, list[SceneObject]]:
    """Draw one scene; returns the RGB image and its shapes sorted left to right.

    Args:
        rng: the only source of randomness.
        size: ``(width, height)`` in px, each in ``[MIN_SIDE, MAX_SIDE]``; drawn by
            :func:`sample_size` when omitted.
        count: number of shapes, 1 to 3; uniform when omitted.

    Raises:
        ValueError: if ``size`` or ``count`` is out of range.
    """
    width, height = size if size is not None else sample_size(rng)
    if not (MIN_SIDE <= width <= MAX_SIDE and MIN_SIDE <= height <= MAX_SIDE):
        raise ValueError(f"size must be within [{MIN_SIDE}, {MAX_SIDE}] px per side, got {size}")
    count = rng.randint(1, 3) if count is None else count
    if not 1 <= count <= 3:
        raise ValueError(f"count must be 1, 2 or 3, got {count}")
    background = (rng.randint(205, 255), rng.randint(205, 255), rng.randint(205, 255))
    image = Image.new("RGB", (width, height), background)
    draw = ImageDraw.Draw(image)
    objects = _place(rng, width, height, count)
    for obj in objects:
        _draw(draw, obj, _jitter(rng, COLOURS[obj.colour], COLOUR_JITTER))
    return image, objects
