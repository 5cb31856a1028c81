"""M-RoPE position ids of a prompt (Qwen2-VL, Wang et al. 2024, "Qwen2-VL: Enhancing Vision-Language
Model's Perception of the World at Any Resolution", arXiv:2409.12191, §2.1).

Each token has three position ids (temporal, height, width). A text token's three are equal and one
more than the previous token's largest; an image's merged tokens, in row-major order over its
``t x (h / merge) x (w / merge)`` grid, take ``start + (ti, hi, wi)``, ``start`` being where the text
before it left off; the text after the image resumes at ``start + max(h, w) / merge``. After the prompt,
token ``i`` (a generated one) sits at ``i + delta`` in all three rows, ``delta`` being the prompt's
largest id plus one less its length (transformers' ``Qwen2VLModel.get_rope_index`` and its
``mrope_position_deltas``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def mrope_positions(token_ids: Sequence[int], image_token_id: int, token_counts: Sequence[int],
                    grids: Sequence[Sequence[int]], merge_size: int) -> tuple[torch.Tensor, int]:
    """Position ids ``[3, len(token_ids)]`` (int64) of a prompt and its ``delta``.

    Args:
        token_ids: the prompt with each image's placeholder expanded to its tokens.
        image_token_id: the placeholder id; its first ``sum(token_counts)`` occurrences are the images'
            tokens, in order (later ones are generated text that happens to equal it).
        token_counts: image tokens of each image.
        grids: each image's patch grid ``(height, width)`` (one frame) or ``(frames, height, width)``,
            in patches before merging.
        merge_size: patches merged per side into one token (2).

    Raises:
        ValueError: counts and grids disagree, or the prompt holds fewer image tokens than they say.
    """
    if len(token_counts) != len(grids):
        raise ValueError(f"{len(token_counts)} image token counts but {len(grids)} grids")
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    total = len(ids)
    image_at = (ids == image_token_id).nonzero().flatten().tolist()
    positions = torch.empty(3, total, dtype=torch.long)
    cursor, current, used = 0, 0, 0  # next token to place, next text position, image tokens consumed
    for count, grid in zip(token_counts, grids, strict=True):
        t, h, w = (1, *grid) if len(grid) == 2 else tuple(grid)
        h, w = h // merge_size, w // merge_size
        if t * h * w != count:
            raise ValueError(f"an image of {count} tokens cannot have the grid {tuple(grid)} (merge {merge_size})")
        if used + count > len(image_at):
            raise ValueError(f"the prompt holds {len(image_at)} image tokens, fewer than its images' {used + count}")
        start = image_at[used]
        text = start - cursor
        positions[:, cursor:start] = torch.arange(current, current + text)
        current += text
        grid_t, grid_h, grid_w = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        positions[:, start:start + count] = torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + current
        current += max(h, w)
        cursor, used = start + count, used + count
    positions[:, cursor:] = torch.arange(current, current + total - cursor)
    largest = int(positions.max()) if total else -1
    return positions, largest + 1 - total
