"""The vision towers a LLaVA-family checkpoint may name, one row each.

A tower is transformers' own vision transformer for the checkpoint's ``vision_config``
(``model_type``), built from that config and the checkpoint's weights; the row says which
config and model classes to use and whether its hidden states start with a class token
(CLIP's ``[CLS]``; SigLIP has none), which sets how many patch embeddings an image makes, and
where its features are read: the hidden states the checkpoint's ``vision_feature_layer`` names
(transformers' vision transformers), or the final feature map ``[N, C, h, w]`` flattened to
``[N, h * w, C]`` (a timm tower through transformers' ``TimmWrapperModel``, built by timm with
``pretrained=False`` and filled with the checkpoint's weights, as FastVLM reads it).
Adding a tower is one row (and its image processor, which reads ``preprocessor_config.json``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Final


@dataclass(frozen=True)
class TowerKind:
    """One supported tower.

    Attributes:
        model_type: the ``vision_config.model_type`` it is chosen by.
        config_class, model_class: transformers' class names (``transformers.<name>``).
        class_token: its hidden states hold a class token before the patches.
        final_map: its features are the last feature map ``[N, C, h, w]`` (``last_hidden_state``),
            not selected hidden states.
    """

    model_type: str
    config_class: str
    model_class: str
    class_token: bool
    final_map: bool = False


TOWERS: Final = MappingProxyType({
    "clip_vision_model": TowerKind("clip_vision_model", "CLIPVisionConfig", "CLIPVisionModel", class_token=True),
    "siglip_vision_model": TowerKind("siglip_vision_model", "SiglipVisionConfig", "SiglipVisionModel",
                                     class_token=False),
    "timm_wrapper": TowerKind("timm_wrapper", "TimmWrapperConfig", "TimmWrapperModel", class_token=False,
                              final_map=True),
})
