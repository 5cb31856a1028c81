"""M-RoPE position ids of a prompt (Qwen2-VL, Wang et al. 2024, "Qwen2-VL: Enhancing Vision-Language
Model's Perception of the World at Any Resolution", arXiv:2409.12191, §2.1).

Each token has three position ids (temporal, height, width). A text token's three are equal and one
more than the previous token's largest; an image's (or a video's) merged tokens, in row-major order over
its ``t x (h / merge) x (w / merge)`` grid, take ``start + (floor(ti * step), hi, wi)``, ``start`` being where
the text before it left off and ``step`` 1 but for Qwen2.5-VL's videos, whose temporal patches are spaced by
time: ``step = tokens_per_second * seconds per temporal patch`` (float32, as transformers computes it); the text after the image resumes
at ``start + max(h, w) / merge``. After the prompt,
token ``i`` (a generated one) sits at ``i + delta`` in all three rows, ``delta`` being the prompt's last
token's largest id plus one less its length: transformers' ``generate`` continues each row from the last
token's (for a prompt that ends in text, as chat templates do, its three ids are equal). For images that is
also the prompt's largest id (``get_rope_index``'s ``mrope_position_deltas``); a Qwen2.5-VL video's
temporal ids may pass the text after it, and ``generate`` still continues from the last token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def mrope_positions(token_ids: Sequence[int], placeholder_ids: int | Sequence[int], token_counts: Sequence[int],
                    grids: Sequence[Sequence[int]], merge_size: int, second_per_grid: Sequence[float] = (),
                    tokens_per_second: float = 0.0) -> tuple[torch.Tensor, int]:
    """Position ids ``[3, len(token_ids)]`` (int64) of a prompt and its ``delta``.

    Args:
        token_ids: the prompt with each image's placeholder expanded to its tokens.
        placeholder_ids: the image (and video) token ids; their first ``sum(token_counts)`` occurrences are
            the images' tokens, in order (later ones are generated text that happens to equal one).
        token_counts: image tokens of each image (a video is one image of several temporal patches).
        grids: each image's patch grid ``(height, width)`` (one frame) or ``(temporal patches, height, width)``,
            in patches before merging.
        merge_size: patches merged per side into one token (2).
        second_per_grid: seconds of video each image's temporal patch spans (0 or empty: a still image);
            transformers' ``second_per_grid_ts``.
        tokens_per_second: Qwen2.5-VL's temporal positions per second of video (0: Qwen2-VL, step 1).

    Raises:
        ValueError: counts and grids disagree, or the prompt holds fewer image tokens than they say.
    """
    if len(token_counts) != len(grids):
        raise ValueError(f"{len(token_counts)} image token counts but {len(grids)} grids")
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    total = len(ids)
    placeholders = torch.as_tensor([placeholder_ids] if isinstance(placeholder_ids, int) else list(placeholder_ids))
    image_at = torch.isin(ids, placeholders).nonzero().flatten().tolist()
    seconds = list(second_per_grid) or [0.0] * len(grids)
    positions = torch.empty(3, total, dtype=torch.long)
    cursor, current, used = 0, 0, 0  # next token to place, next text position, image tokens consumed
    for count, grid, second in zip(token_counts, grids, seconds, strict=True):
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
        if second and tokens_per_second:  # transformers' get_rope_index and get_vision_position_ids, in float32
            temporal = (torch.arange(t) * (tokens_per_second * torch.tensor(second, dtype=torch.float32))).long()
        else:
            temporal = torch.arange(t)
        grid_t, grid_h, grid_w = torch.meshgrid(temporal, torch.arange(h), torch.arange(w), indexing="ij")
        positions[:, start:start + count] = torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + current
        current += max(h, w)
        cursor, used = start + count, used + count
    positions[:, cursor:] = torch.arange(current, current + total - cursor)
    last = int(positions[:, -1].max()) if total else -1
    return positions, last + 1 - total
