"""The vision tower (transformers' own CLIP or SigLIP vision transformer, a row of
:data:`~mm_serve.models.vision_towers.TOWERS`) plus LLaVA feature selection.

Features come from the hidden state(s) named by ``vision_feature_layer`` (an
index or a list, concatenated along the hidden dimension); the ``default``
strategy drops the first position (CLIP's class token in LLaVA-1.5; for a tower without
one, the first patch, as transformers' LLaVA does), ``full`` keeps it.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

from mm_serve.models.model_config import VisionConfig
from mm_serve.models.vision_towers import TOWERS


class VisionEncoder(nn.Module):
    """``pixel_values [N, 3, H, W]`` → patch features ``[N, num_image_tokens, hidden * num_layers]``.

    ``num_encoded_tiles`` counts the ``[3, H, W]`` inputs that went through the tower (an
    any-resolution image is several); images are counted by
    :meth:`~mm_serve.models.llava.MultimodalLM.encode_image_list`.
    """

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        kind = TOWERS[cfg.tower]
        hf_cfg = getattr(transformers, kind.config_class)(**{k: v for k, v in cfg.hf_config.items() if k != "model_type"})
        hf_cfg._attn_implementation = "sdpa"
        self.tower = getattr(transformers, kind.model_class)(hf_cfg)
        self.final_map = kind.final_map
        self.num_encoded_tiles = 0

    @property
    def out_features(self) -> int:
        return self.config.hidden_size * len(self.config.feature_layers)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if self.final_map:  # a timm tower: its last feature map [N, C, h, w] -> [N, h * w, C]
            self.num_encoded_tiles += int(pixel_values.shape[0])
            return self.tower(pixel_values, return_dict=True).last_hidden_state.flatten(2).transpose(1, 2)
        out = self.tower(pixel_values, output_hidden_states=True, return_dict=True)
        hidden_states = out.hidden_states
        pool = [hidden_states[i] for i in self.config.feature_layers]
        if self.config.select_strategy == "default":
            pool = [h[:, 1:] for h in pool]
        self.num_encoded_tiles += int(pixel_values.shape[0])
        return pool[0] if len(pool) == 1 else torch.cat(pool, dim=-1)
