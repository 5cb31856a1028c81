"""Any-resolution arithmetic of LLaVA-NeXT and LLaVA-OneVision: the tile grid an image gets and the
image tokens it makes.

Follows transformers' ``select_best_resolution``, ``image_size_to_num_patches``,
``get_anyres_image_grid_shape`` and ``LlavaNextProcessor._get_number_of_features`` (OneVision: its
processor's ``_get_unpadded_features``, with the ``anyres_max_N`` pooling) step for step, so the
prompt expansion here and the features the model packs always agree in count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Size = tuple[int, int]  # (height, width), pixels


def select_best_resolution(size: Size, candidates: Sequence[Sequence[int]]) -> Size:
    """The candidate (height, width) that keeps most of an image of ``size`` (height, width) once
    scaled into it, and among those wastes the least area (LLaVA-NeXT's rule).

    Raises:
        ValueError: no candidates.
    """
    if not candidates:
        raise ValueError("image_grid_pinpoints is empty")
    height, width = size
    best: Size | None = None
    best_effective, best_wasted = 0, float("inf")
    for cand_h, cand_w in candidates:
        scale = min(cand_w / width, cand_h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = cand_h * cand_w - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (int(cand_h), int(cand_w)), effective, wasted
    assert best is not None  # the first candidate always beats effective 0
    return best


def grid_shape(size: Size, candidates: Sequence[Sequence[int]], tile: int) -> Size:
    """(rows, columns) of ``tile``-pixel tiles of an image of ``size`` at its best resolution."""
    height, width = select_best_resolution(size, candidates)
    return height // tile, width // tile


def num_tiles(size: Size, candidates: Sequence[Sequence[int]], tile: int) -> int:
    """Tiles an image of ``size`` goes through the tower as: its grid's, plus the whole image once."""
    rows, cols = grid_shape(size, candidates, tile)
    return rows * cols + 1


def unpadded_grid(size: Size, rows: int, cols: int) -> Size:
    """(rows, columns) of feature positions left of a ``rows`` x ``cols`` grid once the padding that
    fitted an image of ``size`` (height, width) into it is cut off (transformers' ``unpad_image``)."""
    height, width = size
    if width / height > cols / rows:
        new_height = int(round(height * (cols / width), 7))
        rows -= 2 * ((rows - new_height) // 2)
    else:
        new_width = int(round(width * (rows / height), 7))
        cols -= 2 * ((cols - new_width) // 2)
    return rows, cols


def anyres_cap(vision_aspect_ratio: str) -> int:
    """N of LLaVA-OneVision's ``vision_aspect_ratio`` ``anyres_max_N``: the tiles' worth an image's grid
    features are pooled down to (:func:`pooled_grid`).

    Raises:
        ValueError: any other value, or N below 1.
    """
    cap = vision_aspect_ratio.removeprefix("anyres_max_")
    if cap == vision_aspect_ratio or not cap.isdigit() or int(cap) < 1:
        raise ValueError(f"vision_aspect_ratio {vision_aspect_ratio!r} is not supported (anyres_max_N)")
    return int(cap)


def max_tiles(candidates: Sequence[Sequence[int]], tile: int) -> int:
    """The most tower passes one image takes: the largest grid's tiles plus the whole-image tile."""
    return 1 + max((h // tile) * (w // tile) for h, w in candidates)


POOL_TOLERANCE = 1.1  # OneVision pools only when the grid's side exceeds the cap's by more than this


def pooled_grid(rows: int, cols: int, per_side: int, max_num_patches: int) -> Size:
    """(rows, columns) of an unpadded ``rows`` x ``cols`` feature map after LLaVA-OneVision's
    ``anyres_max_N`` pooling: when its area exceeds ``max_num_patches`` tiles of ``per_side`` squared
    positions by more than ``POOL_TOLERANCE`` in side, both sides are divided by that ratio and floored
    (transformers' ``LlavaOnevisionModel.pack_image_features``); ``max_num_patches`` 0: unchanged."""
    if max_num_patches <= 0:
        return rows, cols
    ratio = math.sqrt(rows * cols / (max_num_patches * per_side**2))
    if ratio > POOL_TOLERANCE:
        return int(rows // ratio), int(cols // ratio)
    return rows, cols


def num_image_tokens(size: Size, candidates: Sequence[Sequence[int]], tile: int, patch: int,
                     class_token: bool, drop_first: bool, max_num_patches: int = 0) -> int:
    """Image tokens an image of ``size`` (height, width) makes: its unpadded tile features (pooled by
    :func:`pooled_grid` under ``max_num_patches``) with one newline per row, and the whole image's
    features (``tile // patch`` squared positions, plus the tower's class token, less one when the
    ``default`` strategy drops the first position).

    Raises:
        ValueError: no candidates.
    """
    per_side = tile // patch
    rows, cols = grid_shape(size, candidates, tile)
    kept_rows, kept_cols = unpadded_grid(size, rows * per_side, cols * per_side)
    kept_rows, kept_cols = pooled_grid(kept_rows, kept_cols, per_side, max_num_patches)
    base = per_side * per_side + (1 if class_token else 0)
    return kept_rows * kept_cols + kept_rows + base - (1 if drop_first else 0)


def max_image_tokens(candidates: Sequence[Sequence[int]], tile: int, patch: int, class_token: bool,
                     drop_first: bool, max_num_patches: int = 0) -> int:
    """An upper bound of :func:`num_image_tokens` over every image size: the largest grid with nothing
    cut, and under ``max_num_patches`` at most that many tiles' positions (times the tolerance squared,
    below which nothing is pooled) plus a newline for each of the grid's rows."""
    per_side = tile // patch
    grid = max((h // tile) * per_side * ((w // tile) * per_side + 1) for h, w in candidates)
    if max_num_patches > 0:
        rows = max(h // tile for h, _ in candidates) * per_side
        grid = min(grid, int(POOL_TOLERANCE**2 * max_num_patches * per_side**2) + rows)
    return grid + per_side * per_side + (1 if class_token else 0) - (1 if drop_first else 0)
