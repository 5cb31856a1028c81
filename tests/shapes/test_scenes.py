"""Scene generator: counts, sizes, colours, non-overlap, ordering, reproducibility."""

from __future__ import annotations

import numpy as np
import pytest

from mm_serve.shapes.scenes import (
    COLOURS,
    GAP_PX,
    MAX_SIDE,
    MIN_CENTRE_SEPARATION,
    MIN_SIDE,
    SHAPES,
    draw_scene,
    scene_rng,
)

N_SCENES = 300


def _scenes(namespace: str = "test", seed: int = 0, n: int = N_SCENES):
    return [draw_scene(scene_rng(namespace, seed, i)) for i in range(n)]


def test_counts_sizes_and_vocabulary() -> None:
    counts = set()
    aspects = []
    for image, objects in _scenes():
        width, height = image.size
        assert image.mode == "RGB"
        assert MIN_SIDE <= width <= MAX_SIDE and MIN_SIDE <= height <= MAX_SIDE
        assert 1 <= len(objects) <= 3
        counts.add(len(objects))
        aspects.append(max(width, height) / min(width, height))
        for obj in objects:
            assert obj.colour in COLOURS and obj.shape in SHAPES
            x0, y0, x1, y1 = obj.bbox
            assert 0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height
    assert counts == {1, 2, 3}
    assert max(aspects) > 2.0 and min(aspects) < 1.2  # a real spread of aspect ratios


def test_boxes_disjoint_and_left_to_right() -> None:
    for image, objects in _scenes():
        centres = [obj.centre_x for obj in objects]
        assert centres == sorted(centres)
        for i, a in enumerate(objects):
            for b in objects[i + 1 :]:
                ax0, ay0, ax1, ay1 = a.bbox
                bx0, by0, bx1, by1 = b.bbox
                assert ax1 + GAP_PX <= bx0 or bx1 + GAP_PX <= ax0 or ay1 + GAP_PX <= by0 or by1 + GAP_PX <= ay0
                assert b.centre_x - a.centre_x >= MIN_CENTRE_SEPARATION * image.width


def test_shape_pixels_have_their_colour() -> None:
    for image, objects in _scenes(n=50):
        pixels = np.asarray(image).astype(int)
        for obj in objects:
            x0, y0, x1, y1 = obj.bbox
            centre = pixels[(y0 + y1) // 2 + (y1 - y0) // 6, (x0 + x1) // 2]  # inside all three shapes
            assert np.abs(centre - np.array(COLOURS[obj.colour])).max() <= 12


def test_seeded_reproducibility_and_streams_differ() -> None:
    first = _scenes(seed=3, n=20)
    again = _scenes(seed=3, n=20)
    other = _scenes(seed=4, n=20)
    assert [o for _, o in first] == [o for _, o in again]
    assert all(a.tobytes() == b.tobytes() for (a, _), (b, _) in zip(first, again, strict=True))
    assert [o for _, o in first] != [o for _, o in other]


def test_explicit_size_and_count() -> None:
    image, objects = draw_scene(scene_rng("test", 0, 0), size=(512, 48), count=3)
    assert image.size == (512, 48) and len(objects) == 3
    with pytest.raises(ValueError):
        draw_scene(scene_rng("test", 0, 0), size=(40, 100))
    with pytest.raises(ValueError):
        draw_scene(scene_rng("test", 0, 0), count=4)
