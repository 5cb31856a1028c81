"""Vision tower (ViT) shapes of multimodal checkpoints: llava-hf and original LLaVA layouts.

LLaVA-1.5 runs CLIP ViT-L/14 at 336 px (577 positions: 576 patches + CLS) up to the
penultimate layer (``vision_feature_layer = -2``), drops the CLS token
(``vision_feature_select_strategy = "default"``) and projects each of the 576 patch
embeddings with a two-layer MLP into one LLM token (Liu et al., "Improved Baselines
with Visual Instruction Tuning", 2023, §3).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mm_serve.models.llava_next.anyres import anyres_cap, max_image_tokens, max_tiles
from mm_serve.planner.errors import ModelShapeError

# (layers, hidden, heads, intermediate) by ViT size keyword in a tower name.
_TOWER_SIZES: Mapping[str, tuple[int, int, int, int]] = MappingProxyType({
    "base": (12, 768, 12, 3072),
    "large": (24, 1024, 16, 4096),
    "huge": (32, 1280, 16, 5120),
    "so400m": (27, 1152, 16, 4304),
})
# transformers' defaults for vision configs that omit fields.
_VISION_DEFAULTS: Mapping[str, Mapping[str, int]] = MappingProxyType({
    "clip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                          "num_attention_heads": 12, "image_size": 224, "patch_size": 32},
    "siglip_vision_model": {"hidden_size": 768, "intermediate_size": 3072,
                            "num_hidden_layers": 12, "num_attention_heads": 12,
                            "image_size": 224, "patch_size": 16},
})


@dataclass(frozen=True)
class VisionShape:
    """A ViT encoder plus projector; ``image_tokens`` LLM tokens come out per image, from
    ``tiles_per_image`` tower passes of ``image_size`` squared pixels each.

    A tiling family (LLaVA-NeXT, LLaVA-OneVision) makes each image's count from its size; the planner,
    which knows a workload's images by number only, plans every image at the most one can cost: the
    largest grid of ``image_grid_pinpoints`` plus the whole-image tile, and the tokens of an image
    that fills it (:func:`mm_serve.models.llava_next.anyres.max_image_tokens`). A workload of smaller
    images needs less than planned.
    """

    model_type: str
    num_layers: int  # layers actually run (up to the selected feature layer)
    hidden_size: int
    num_heads: int
    intermediate_size: int
    image_size: int  # pixels per side
    patch_size: int  # pixels per side
    has_cls: bool
    image_tokens: int
    projector_params: int
    tiles_per_image: int = 1  # tower passes per image (1 unless the family tiles)

    @property
    def num_patches(self) -> int:
        """Patches of one tower pass."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def pass_tokens(self) -> int:
        """Projected rows one tower pass makes (an untiled image's tokens; a tile's patches)."""
        return self.image_tokens if self.tiles_per_image == 1 else self.num_patches

    @property
    def seq_len(self) -> int:
        """Positions the ViT attends over per image (patches + CLS)."""
        return self.num_patches + (1 if self.has_cls else 0)

    @property
    def layer_params(self) -> int:
        h = self.hidden_size
        return 4 * h * h + 2 * h * self.intermediate_size

    @property
    def params(self) -> int:
        """Tower (run layers + patch embedding) plus projector weights."""
        patch_embed = 3 * self.patch_size * self.patch_size * self.hidden_size
        return self.num_layers * self.layer_params + patch_embed + self.projector_params


def _layers_run(total: int, feature_layer: Any, key: str, where: str) -> int:
    """Encoder layers run to reach ``feature_layer`` (an index into the hidden states,
    negative from the end, or a list of them: the deepest counts).

    Raises:
        ModelShapeError: not an integer (or list of integers) within ``-total..total``.
    """
    layers = feature_layer if isinstance(feature_layer, list) else [feature_layer]
    if not layers or any(isinstance(v, bool) or not isinstance(v, int) or not -total <= v <= total
                         for v in layers):
        raise ModelShapeError(f"{where}: '{key}' must be a layer index in -{total}..{total} "
                              f"(or a list of them), got {feature_layer!r}")
    return max(1, max(total + 1 + v if v < 0 else v for v in layers))


def _tokens(image: int, patch: int, where: str) -> int:
    if image < patch:
        raise ModelShapeError(f"{where}: vision image_size {image} is smaller than its patch_size "
                              f"{patch}: no image tokens")
    return (image // patch) ** 2


def _choice(cfg: Mapping[str, Any], key: str, default: str, allowed: tuple[str, ...], where: str) -> str:
    value = cfg.get(key, default)
    if value not in allowed:
        raise ModelShapeError(f"{where}: '{key}' must be one of {', '.join(allowed)}, got {value!r}")
    return str(value)


def _need(value: Any, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelShapeError(f"{where}: vision '{key}' must be a positive integer, got {value!r}")
    return value


# Qwen2-VL resizes each image to its own patch grid within pixel bounds that reach 16,384 tokens in released
# checkpoints; the planner, which knows images by number only, plans each as a 1024 x 1024 photo's worth
QWEN_PLAN_PIXELS = 1024 * 1024


def vision_from_qwen(vision_cfg: Mapping[str, Any], llm_hidden: int, where: str) -> VisionShape:
    """Vision shape of a Qwen2-VL / Qwen2.5-VL ``vision_config``: every image planned as
    :data:`QWEN_PLAN_PIXELS` pixels, its ``4 t`` patches in one pass of the ViT (full attention, an upper
    bound for Qwen2.5-VL's windowed layers), its merger making ``t`` tokens; no class token.

    Raises:
        ModelShapeError: a field is not a positive integer.
    """
    def field(key: str, default: int) -> int:
        return _need(vision_cfg.get(key, default), key, where)

    patch, merge = field("patch_size", 14), field("spatial_merge_size", 2)
    qwen2 = vision_cfg.get("model_type", "qwen2_vl_vision") == "qwen2_vl_vision"  # else Qwen2.5-VL's fields
    hidden = field("embed_dim", 1280) if qwen2 else field("hidden_size", 1280)
    inter = hidden * field("mlp_ratio", 4) if qwen2 else field("intermediate_size", 3420)
    tokens = QWEN_PLAN_PIXELS // (patch * merge) ** 2
    side = int(math.isqrt(tokens * merge * merge)) * patch  # a square of about 4 t patches
    merged = hidden * merge * merge
    return VisionShape(
        model_type=str(vision_cfg.get("model_type")), num_layers=field("depth", 32), hidden_size=hidden,
        num_heads=field("num_heads", 16), intermediate_size=inter, image_size=side, patch_size=patch,
        has_cls=False, image_tokens=tokens, projector_params=merged * merged + merged * llm_hidden,
    )


def vision_from_hf(
    cfg: Mapping[str, Any], vision_cfg: Mapping[str, Any], llm_hidden: int, where: str
) -> VisionShape:
    """Vision shape of a llava-hf config (``vision_config`` plus top-level feature keys), or of a
    Qwen2-VL one (:func:`vision_from_qwen`)."""
    mtype = str(vision_cfg.get("model_type", "clip_vision_model"))
    if mtype in ("qwen2_vl_vision", "qwen2_5_vl_vision"):
        return vision_from_qwen(vision_cfg, llm_hidden, where)
    if cfg.get("model_type") in ("qwen2_vl", "qwen2_5_vl"):  # a vision_config without its model_type
        return vision_from_qwen({**vision_cfg, "model_type": f"{cfg['model_type']}_vision"}, llm_hidden, where)
    defaults = _VISION_DEFAULTS.get(mtype, _VISION_DEFAULTS["clip_vision_model"])

    def field(key: str) -> int:
        return _need(vision_cfg.get(key, defaults.get(key)), key, where)

    hidden = field("hidden_size")
    has_cls = not mtype.startswith("siglip")
    image, patch = field("image_size"), field("patch_size")
    tokens = _tokens(image, patch, where)
    strategy = _choice(cfg, "vision_feature_select_strategy", "default", ("default", "full"), where)
    if has_cls and strategy == "full":
        tokens += 1
    seq_len = cfg.get("image_seq_length")
    if isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len > 0:
        tokens = seq_len
    tiles = 1
    if cfg.get("image_grid_pinpoints"):
        tiles, tokens = _tiling(cfg, image, patch, has_cls, strategy, where)
    return VisionShape(
        model_type=mtype,
        num_layers=_layers_run(field("num_hidden_layers"), cfg.get("vision_feature_layer", -2),
                               "vision_feature_layer", where),
        hidden_size=hidden, num_heads=field("num_attention_heads"),
        intermediate_size=field("intermediate_size"), image_size=image, patch_size=patch,
        has_cls=has_cls, image_tokens=tokens,
        projector_params=hidden * llm_hidden + llm_hidden * llm_hidden, tiles_per_image=tiles,
    )


def _tiling(cfg: Mapping[str, Any], image: int, patch: int, has_cls: bool, strategy: str,
            where: str) -> tuple[int, int]:
    """(tower passes, image tokens) of the costliest image of a LLaVA-NeXT or LLaVA-OneVision config
    (``image_grid_pinpoints``; OneVision's ``vision_aspect_ratio`` pooling cap).

    Raises:
        ModelShapeError: pinpoints that are not ``[height, width]`` pairs of at least one tile, or a
            ``vision_aspect_ratio`` other than ``anyres_max_N``.
    """
    pinpoints = cfg["image_grid_pinpoints"]
    if not isinstance(pinpoints, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                        and v >= image for v in p) for p in pinpoints):
        raise ModelShapeError(f"{where}: 'image_grid_pinpoints' must be a list of [height, width] "
                              f"of at least the tower's {image} px, got {pinpoints!r}")
    cap = 0
    if cfg.get("model_type") == "llava_onevision":
        try:
            cap = anyres_cap(str(cfg.get("vision_aspect_ratio", "anyres_max_9")))
        except ValueError as e:
            raise ModelShapeError(f"{where}: {e}") from None
    return (max_tiles(pinpoints, image),
            max_image_tokens(pinpoints, image, patch, has_cls, strategy == "default", cap))


def vision_from_tower_name(
    tower: str, cfg: Mapping[str, Any], llm_hidden: int, where: str
) -> VisionShape:
    """Vision shape of an original LLaVA config from ``mm_vision_tower``, a hub name
    such as ``openai/clip-vit-large-patch14-336`` (size keyword, ``patchN``, and the
    resolution, 224 if absent).

    Raises:
        ModelShapeError: the name gives no patch size, or a field is malformed.
    """
    name = tower.lower()
    size = next((k for k in _TOWER_SIZES if k in name), "large")
    layers, hidden, heads, inter = _TOWER_SIZES[size]
    hidden = _need(cfg.get("mm_hidden_size", hidden), "mm_hidden_size", where)
    patch_m = re.search(r"patch(\d+)", name)
    if patch_m is None:
        raise ModelShapeError(f"{where}: cannot tell the patch size of vision tower {tower!r} "
                              "(expected a name like openai/clip-vit-large-patch14-336)")
    image_m = re.search(r"-(\d{3,4})(?:$|[^0-9])", name)
    patch = _need(int(patch_m.group(1)), "patch size", where)
    image = int(image_m.group(1)) if image_m else 224
    has_cls = "siglip" not in name
    tokens = _tokens(image, patch, where)
    feature = _choice(cfg, "mm_vision_select_feature", "patch", ("patch", "cls_patch"), where)
    if has_cls and feature == "cls_patch":
        tokens += 1
    projector = str(cfg.get("mm_projector_type", "linear"))
    mlp_m = re.match(r"mlp(\d+)x", projector)
    depth = int(mlp_m.group(1)) if mlp_m else 1
    if not 1 <= depth <= 8:
        raise ModelShapeError(f"{where}: 'mm_projector_type' {projector!r} has {depth} layers "
                              "(1 to 8 expected, e.g. mlp2x_gelu)")
    return VisionShape(
        model_type="siglip_vision_model" if "siglip" in name else "clip_vision_model",
        num_layers=_layers_run(layers, cfg.get("mm_vision_select_layer", -2), "mm_vision_select_layer", where),
        hidden_size=hidden, num_heads=heads,
        intermediate_size=inter, image_size=image, patch_size=patch, has_cls=has_cls,
        image_tokens=tokens,
        projector_params=hidden * llm_hidden + (depth - 1) * llm_hidden * llm_hidden,
    )
