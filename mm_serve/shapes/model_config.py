"""Architecture of the embedded model: a llava-hf ``LlavaConfig`` and its image preprocessing.

Vision: a CLIP ViT over a ``IMAGE_SIZE`` x ``IMAGE_SIZE`` input in ``PATCH_SIZE``
patches, i.e. ``(IMAGE_SIZE / PATCH_SIZE) ** 2`` = :data:`NUM_IMAGE_TOKENS` patch
embeddings per image once the CLS token is dropped (``vision_feature_select_strategy
= "default"``). Projector: Linear → GELU → Linear into the text model's width.
Text: a Llama decoder with grouped-query attention. Every image is squashed to a
square (no center crop), because captions list shapes left to right and a crop
would cut shapes off at the sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

IMAGE_SIZE = 128
PATCH_SIZE = 16
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class ModelSize:
    """Widths and depths of the two towers (defaults: the shipped checkpoint)."""

    vision_hidden: int = 192
    vision_layers: int = 4
    vision_heads: int = 4
    text_hidden: int = 256
    text_intermediate: int = 768
    text_layers: int = 4
    text_heads: int = 8
    text_kv_heads: int = 2
    max_positions: int = 512


def build_config(vocab_size: int, ids: dict[str, int], size: ModelSize | None = None) -> LlavaConfig:
    """The ``LlavaConfig`` for a tokenizer of ``vocab_size`` tokens.

    Args:
        vocab_size: rows of the embedding and of the LM head.
        ids: token ids of ``"<s>"``, ``"</s>"``, ``"<pad>"`` and ``"<image>"``.
        size: tower sizes; :class:`ModelSize` defaults when omitted.

    Raises:
        KeyError: if ``ids`` lacks one of the four tokens.
    """
    size = size or ModelSize()
    vision = CLIPVisionConfig(
        hidden_size=size.vision_hidden,
        intermediate_size=4 * size.vision_hidden,
        num_hidden_layers=size.vision_layers,
        num_attention_heads=size.vision_heads,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        hidden_act="quick_gelu",
        projection_dim=size.vision_hidden,
    )
    text = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=size.text_hidden,
        intermediate_size=size.text_intermediate,
        num_hidden_layers=size.text_layers,
        num_attention_heads=size.text_heads,
        num_key_value_heads=size.text_kv_heads,
        max_position_embeddings=size.max_positions,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["<image>"],
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_seq_length=NUM_IMAGE_TOKENS,
        tie_word_embeddings=False,
    )


def sincos_2d(grid: int, dim: int, scale: float = 0.5) -> torch.Tensor:
    """``[1 + grid * grid, dim]`` position table: a zero row for CLS, then per patch (row-major)
    sines and cosines of its column (first half of ``dim``) and row (second half)."""
    quarter = dim // 4
    freqs = 1.0 / (100.0 ** (torch.arange(quarter, dtype=torch.float64) / quarter))
    coords = torch.arange(grid, dtype=torch.float64)[:, None] * freqs[None, :]
    table = torch.cat([coords.sin(), coords.cos()], dim=1)  # [grid, dim / 2]
    rows, cols = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    patches = torch.cat([table[cols.flatten()], table[rows.flatten()]], dim=1)
    return scale * torch.cat([torch.zeros(1, dim, dtype=torch.float64), patches]).float()


def image_processor_config() -> dict[str, Any]:
    """``preprocessor_config.json`` for ``CLIPImageProcessor``: squash to a square, no crop."""
    return {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": True,
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "resample": 3,
        "do_center_crop": False,
        "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(IMAGE_MEAN),
        "image_std": list(IMAGE_STD),
        "do_convert_rgb": True,
    }


def processor_config() -> dict[str, Any]:
    """``processor_config.json`` so ``AutoProcessor`` builds a ``LlavaProcessor`` that expands ``<image>``."""
    return {
        "processor_class": "LlavaProcessor",
        "patch_size": PATCH_SIZE,
        "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1,
        "image_token": "<image>",
    }
