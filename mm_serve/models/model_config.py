"""Parse a checkpoint's ``config.json`` (llava-hf ``LlavaConfig``, or a plain Llama-family decoder:
Llama, Mistral, Qwen2) into frozen dataclasses; which architectures are served is the registry's
(:mod:`mm_serve.models.registry`).

Both the transformers 4.x keys (``rope_theta``, ``rope_scaling``) and the 5.x
key (``rope_parameters``) are understood.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mm_serve.models.vision_towers import TOWERS


class CheckpointError(ValueError):
    """A model directory is missing files or holds a config we cannot serve."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters (Su et al. 2021, RoFormer).

    ``rope_type`` is ``default``, ``linear`` (position interpolation, Chen et al. 2023)
    or ``llama3`` (Llama 3.1 frequency-dependent scaling).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # M-RoPE (Qwen2-VL, Wang et al. 2024, arXiv:2409.12191 §2.1): the rotary pairs split into temporal,
    # height and width sections, each turned by its own position id; () for plain 1-D RoPE
    mrope_section: tuple[int, ...] = ()


@dataclass(frozen=True)
class TextConfig:
    """Shape of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    rope: RopeConfig
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    qkv_bias: bool = False  # q, k and v projections have biases although o_proj has none (Qwen2)


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower and projector of a llava-hf checkpoint."""

    hf_config: dict[str, Any]  # the tower's config kwargs, as in config.json
    tower: str  # its vision_config.model_type (a row of mm_serve.models.vision_towers.TOWERS)
    class_token: bool  # its hidden states start with a class token (CLIP) or not (SigLIP)
    image_size: int  # pixels, square input of the tower
    patch_size: int  # pixels
    hidden_size: int
    image_token_index: int
    feature_layers: tuple[int, ...]  # hidden-state indices, concatenated in this order
    feature_layer_is_list: bool
    select_strategy: str  # "default" drops CLS, "full" keeps it
    projector_hidden_act: str
    projector_bias: bool
    # LLaVA-NeXT: the (height, width) resolutions an image may be tiled at (empty: one fixed size)
    grid_pinpoints: tuple[tuple[int, int], ...] = ()
    # LLaVA-OneVision: an image's unpadded grid features are pooled (bilinear) down to about this many
    # tiles' worth when they exceed it by 10 % (``vision_aspect_ratio`` ``anyres_max_N``; 0: never)
    max_num_patches: int = 0
    # LLaVA-OneVision: in a prompt of several images, each is one square-padded tile (no grid)
    multi_image_untiled: bool = False
    # Qwen2-VL: each image resized to its own grid of patches within (min, max) pixels, every
    # ``merge_size`` x ``merge_size`` patches merged into one token (0: a fixed-size or tiling tower)
    merge_size: int = 0
    pixel_bounds: tuple[int, int] = (0, 0)  # (min_pixels, max_pixels) of the image processor
    # Qwen2-VL: the video placeholder (None: the family takes no video), frames per temporal patch, and
    # Qwen2.5-VL's M-RoPE temporal positions per second of video (0: one per temporal patch, as Qwen2-VL)
    video_token_index: int | None = None
    temporal_patch_size: int = 2
    tokens_per_second: float = 0.0

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        """The token ids whose positions take visual features: the image token, and the video token
        where the family takes videos."""
        if self.video_token_index is None:
            return (self.image_token_index,)
        return (self.image_token_index, self.video_token_index)

    @property
    def dynamic_resolution(self) -> bool:
        """Whether each image is resized to its own patch grid (Qwen2-VL), its tokens following from it."""
        return self.merge_size > 0

    @property
    def any_resolution(self) -> bool:
        """Whether each image is tiled at its own best resolution (LLaVA-NeXT), so its token count
        depends on its size."""
        return bool(self.grid_pinpoints)

    @property
    def max_image_tokens(self) -> int:
        """The most image tokens one image can make (what a ring's feature rows are sized for)."""
        if self.dynamic_resolution:  # the resize keeps an image within max_pixels
            return self.pixel_bounds[1] // (self.patch_size * self.merge_size) ** 2
        if not self.grid_pinpoints:
            return self.num_image_tokens
        from mm_serve.models.llava_next.anyres import max_image_tokens

        return max_image_tokens(self.grid_pinpoints, self.image_size, self.patch_size, self.class_token,
                                self.select_strategy == "default", self.max_num_patches)

    @property
    def num_image_tokens(self) -> int:
        """Image tokens each ``<image>`` placeholder expands to: the tower's positions (patches, and
        its class token if it has one) less the first position under the ``default`` strategy
        (transformers' ``LlavaProcessor``: patches + ``num_additional_image_tokens``, minus one for
        ``default``). For an any-resolution family, the tokens of the whole-image tile alone: the
        fewest an image makes. For a dynamic-resolution family, one: before an image is sized its
        count is unknown (the resize rounds to whole merged patches, so not even ``min_pixels`` bounds it)."""
        if self.dynamic_resolution:
            return 1
        positions = (self.image_size // self.patch_size) ** 2 + (1 if self.class_token else 0)
        return positions - (1 if self.select_strategy == "default" else 0)


@dataclass(frozen=True)
class ModelConfig:
    """A whole checkpoint: the decoder plus, for llava, the vision side."""

    model_type: str  # "llava" or "llama"
    text: TextConfig
    vision: VisionConfig | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_multimodal(self) -> bool:
        return self.vision is not None


def _rope_from(cfg: dict[str, Any]) -> RopeConfig:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    merged: dict[str, Any] = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = str(merged.get("rope_type", merged.get("type", "default")))
    if rope_type == "mrope":  # Qwen2-VL's transformers 4.x spelling: default frequencies, sectioned positions
        rope_type = "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise CheckpointError(
            f"rope type '{rope_type}' is not supported (supported: default, linear, llama3)"
        )
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
        mrope_section=tuple(int(v) for v in merged.get("mrope_section") or ()),
    )


def eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


# decoders our runner implements (Llama layers; Qwen2: q/k/v biases; Qwen2-VL's and Qwen2.5-VL's text models
# are Qwen2 with M-RoPE)
TEXT_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen2_vl_text", "qwen2_5_vl_text")
QWEN2_TYPES = ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text")


def _served_positions(cfg: dict[str, Any]) -> int:
    """The longest context served: ``max_position_embeddings``, capped at the sliding window where a
    layer attends within one (Mistral, Qwen2 with ``use_sliding_window``): our layers attend to the
    whole context, which equals sliding-window attention exactly while the context fits the window."""
    limit = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    sliding = cfg.get("use_sliding_window", cfg.get("model_type") == "mistral")
    if any(kind == "sliding_attention" for kind in cfg.get("layer_types") or []):
        sliding = True
    return min(limit, int(window)) if sliding and window else limit


SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings")  # when given: positive integers


def parse_text_config(cfg: dict[str, Any]) -> TextConfig:
    """Build a :class:`TextConfig` from a Llama-family config dict.

    Raises:
        CheckpointError: a required key is missing, a size is not a positive integer (naming the key), or the
            architecture is unsupported.
    """
    model_type = cfg.get("model_type", "llama")
    for key in SIZE_KEYS:
        value = cfg.get(key, 1)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise CheckpointError(f"config.json {key} must be a positive integer, got {value!r}")
    if model_type not in TEXT_MODEL_TYPES:
        raise CheckpointError(f"text model_type '{model_type}' is not supported ({', '.join(TEXT_MODEL_TYPES)})")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act '{cfg.get('hidden_act')}' is not supported (silu)")
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        return TextConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=_served_positions(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)) and model_type not in QWEN2_TYPES,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope=_rope_from(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids(cfg.get("eos_token_id")),
            qkv_bias=model_type in QWEN2_TYPES,
        )
    except KeyError as exc:
        raise CheckpointError(f"config.json text config lacks required key {exc}") from None


def parse_vision_config(cfg: dict[str, Any]) -> VisionConfig:
    """Build a :class:`VisionConfig` from a llava-hf config dict (its ``vision_config`` and the
    LLaVA keys around it).

    Raises:
        CheckpointError: an unsupported tower or strategy, or no image token index.
    """
    vcfg = dict(cfg.get("vision_config") or {})
    tower = TOWERS.get(str(vcfg.get("model_type", "clip_vision_model")))
    if tower is None:
        raise CheckpointError(
            f"vision tower '{vcfg.get('model_type')}' is not supported ({', '.join(TOWERS)})"
        )
    layer = cfg.get("vision_feature_layer", -2)
    is_list = isinstance(layer, list)
    layers = tuple(int(v) for v in layer) if is_list else (int(layer),)
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise CheckpointError(f"vision_feature_select_strategy '{strategy}' (allowed: default, full)")
    image_token = cfg.get("image_token_index", cfg.get("image_token_id"))
    if image_token is None:
        raise CheckpointError("llava config.json lacks image_token_index")
    return VisionConfig(
        hf_config=vcfg,
        tower=tower.model_type,
        class_token=tower.class_token,
        image_size=int(vcfg.get("image_size", 224)),
        patch_size=int(vcfg.get("patch_size", 32)),
        hidden_size=int(vcfg.get("hidden_size", 768)),
        image_token_index=int(image_token),
        feature_layers=layers,
        feature_layer_is_list=is_list,
        select_strategy=strategy,
        projector_hidden_act=str(cfg.get("projector_hidden_act", "gelu")),
        projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
    )
