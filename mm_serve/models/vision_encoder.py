"""The vision tower: transformers' CLIP vision transformer plus LLaVA feature selection.

Features come from the hidden state(s) named by ``vision_feature_layer`` (an
index or a list, concatenated along the hidden dimension); the ``default``
strategy drops the CLS position (LLaVA-1.5), ``full`` keeps it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import CLIPVisionConfig, CLIPVisionModel

from mm_serve.models.model_config import VisionConfig


class VisionEncoder(nn.Module):
    """``pixel_values [N, 3, H, W]`` → patch features ``[N, num_image_tokens, hidden * num_layers]``.

    ``num_encoded_images`` counts images that went through the tower, so tests and
    metrics can prove an image was encoded once.
    """

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        hf_cfg = CLIPVisionConfig(**{k: v for k, v in cfg.hf_config.items() if k != "model_type"})
        hf_cfg._attn_implementation = "sdpa"
        self.tower = CLIPVisionModel(hf_cfg)
        self.num_encoded_images = 0

    @property
    def out_features(self) -> int:
        return self.config.hidden_size * len(self.config.feature_layers)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.tower(pixel_values, output_hidden_states=True, return_dict=True)
        hidden_states = out.hidden_states
        pool = [hidden_states[i] for i in self.config.feature_layers]
        if self.config.select_strategy == "default":
            pool = [h[:, 1:] for h in pool]
        self.num_encoded_images += int(pixel_values.shape[0])
        return pool[0] if len(pool) == 1 else torch.cat(pool, dim=-1)
