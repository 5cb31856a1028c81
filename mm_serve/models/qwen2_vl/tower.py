"""The Qwen2-VL (and Qwen2.5-VL) vision tower: transformers' own ViT with 2-D rotary positions over each
image's patch grid and the merger that maps every ``merge x merge`` patches to one decoder token.

Images are batched as transformers does: all their patches concatenated (``[sum(t*h*w), C*T*P*P]``), with
each image's grid; attention stays within an image (the tower's ``cu_seqlens``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mm_serve.models.model_config import VisionConfig

# (transformers config class, module of its tower class, tower class) by vision_config model_type
_TOWERS = {
    "qwen2_vl_vision": ("Qwen2VLVisionConfig", "transformers.models.qwen2_vl.modeling_qwen2_vl",
                        "Qwen2VisionTransformerPretrainedModel"),
    "qwen2_5_vl_vision": ("Qwen2_5_VLVisionConfig", "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
                          "Qwen2_5_VisionTransformerPretrainedModel"),
}


class MergedPatchTower(nn.Module):
    """``patches [sum(t*h*w), C*T*P*P]`` of images with grids ``[n, 3]`` → merged embeddings
    ``[sum(t*h*w) / merge**2, text_hidden]`` (the projection into the decoder is the merger's).

    ``num_encoded_tiles`` counts patches through the tower (the unit of its work).
    """

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        import importlib

        import transformers

        config_class, module, model_class = _TOWERS[cfg.tower]
        hf_cfg = getattr(transformers, config_class)(**{k: v for k, v in cfg.hf_config.items() if k != "model_type"})
        hf_cfg._attn_implementation = "sdpa"
        self.tower = getattr(importlib.import_module(module), model_class)._from_config(hf_cfg)
        self.config = cfg
        self.num_encoded_tiles = 0

    def forward(self, patches: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        self.num_encoded_tiles += int(patches.shape[0])
        dtype = next(self.tower.parameters()).dtype
        return self.tower(patches.to(dtype), grid_thw=grids, return_dict=True).pooler_output

    def encode(self, images: Sequence[torch.Tensor], grids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Each image's merged embeddings ``[t*h*w / merge**2, text_hidden]`` from its patches ``[t*h*w, C*T*P*P]``
        and its grid ``(h, w)`` (one frame) or ``(t, h, w)``, all in one pass of the tower."""
        thw = [list(g) if len(g) == 3 else [1, *g] for g in grids]
        out = self(torch.cat(list(images), dim=0), torch.tensor(thw, dtype=torch.long, device=images[0].device))
        merge = self.config.merge_size ** 2
        return list(torch.split(out, [t * h * w // merge for t, h, w in thw], dim=0))
