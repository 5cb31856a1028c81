"""LLaVA-NeXT's (and LLaVA-OneVision's) packing of one image's tile features into its image-token embeddings.

The whole image's features come first; then the grid tiles' features are laid out as one feature
map of the image at its best resolution, the rows and columns that only padding made are cut
(:func:`~mm_serve.models.llava_next.anyres.unpadded_grid`), and the ``image_newline`` embedding
follows every row; OneVision first pools a map larger than ``anyres_max_N`` tiles (bilinear).
Follows transformers' ``LlavaNextModel.pack_image_features`` (the ``spatial_unpad`` merge) and
``LlavaOnevisionModel.pack_image_features``, so the counts of :func:`~mm_serve.models.llava_next.anyres.num_image_tokens`
and these rows always agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mm_serve.models.llava_next.anyres import Size, grid_shape, pooled_grid, unpadded_grid


def pack_image(features: torch.Tensor, size: Size, candidates: Sequence[Sequence[int]], tile: int,
               per_side: int, newline: torch.Tensor, max_num_patches: int = 0) -> torch.Tensor:
    """One image's image-token embeddings ``[tokens, hidden]``.

    Args:
        features: projected features of its tiles ``[tiles, per_side * per_side, hidden]``, the whole
            image first, then the grid tiles row by row.
        size: its original (height, width), pixels.
        candidates: ``image_grid_pinpoints``; ``tile``: the tower's input size, pixels.
        per_side: feature positions along one side of a tile (``tile // patch``).
        newline: ``image_newline`` ``[hidden]``.
        max_num_patches: OneVision's ``anyres_max_N`` (:func:`~mm_serve.models.llava_next.anyres.pooled_grid`); 0: none.

    Raises:
        ValueError: ``features`` does not hold the tiles the grid of ``size`` makes.
    """
    base, grid = features[0], features[1:]
    if grid.shape[0] == 0:
        return torch.cat([base, newline[None].to(base)], dim=0)
    rows, cols = grid_shape(size, candidates, tile)
    if grid.shape[0] != rows * cols or grid.shape[1] != per_side * per_side:
        raise ValueError(f"{grid.shape[0]} tiles of {grid.shape[1]} positions for a {rows}x{cols} grid of "
                         f"{per_side}x{per_side}")
    hidden = grid.shape[-1]
    # [rows, cols, per_side, per_side, hidden] -> a [hidden, rows * per_side, cols * per_side] map
    fmap = grid.view(rows, cols, per_side, per_side, hidden).permute(4, 0, 2, 1, 3).reshape(
        hidden, rows * per_side, cols * per_side)
    kept_rows, kept_cols = unpadded_grid(size, rows * per_side, cols * per_side)
    top, left = (rows * per_side - kept_rows) // 2, (cols * per_side - kept_cols) // 2
    fmap = fmap[:, top:top + kept_rows, left:left + kept_cols]
    pooled = pooled_grid(kept_rows, kept_cols, per_side, max_num_patches)
    if pooled != (kept_rows, kept_cols):
        fmap = F.interpolate(fmap[None], list(pooled), mode="bilinear")[0]
        kept_rows, kept_cols = pooled
    column = newline.to(fmap)[:, None, None].expand(hidden, kept_rows, 1)
    packed = torch.cat([fmap, column], dim=-1).flatten(1, 2).transpose(0, 1)
    return torch.cat([base, packed], dim=0)
