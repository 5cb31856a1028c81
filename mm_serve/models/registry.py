"""The model families served, keyed by the checkpoint's architecture (``config.json``
``architectures[0]``, else its ``model_type``).

Each family is one row of :data:`FAMILIES`: the architectures it serves, how its config is read,
and the transformers class that is the golden reference for it. A checkpoint of any other
architecture is refused at load with the list of those supported.

* ``LlavaForConditionalGeneration`` (llava): Llama / Mistral / Qwen2 decoder; CLIP or SigLIP tower.
* ``LlavaNextForConditionalGeneration`` (llava_next): the same, images tiled at any resolution.
* ``LlavaOnevisionForConditionalGeneration`` (llava_onevision): the same, grid features pooled to
  ``anyres_max_N`` tiles; images sharing a prompt untiled.
* ``FastVlmForConditionalGeneration`` (fast_vlm): a timm tower (FastViTHD) read at its last feature map.
* ``Qwen2VLForConditionalGeneration`` (qwen2_vl): a ViT with 2-D rotary positions over each image's own
  patch grid and a patch merger, a Qwen2 decoder with M-RoPE.
* ``Qwen2_5_VLForConditionalGeneration`` (qwen2_5_vl): the same with a windowed-attention ViT.
* ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` (decoder): text only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from mm_serve.ground.dtypes import declared_dtypes
from mm_serve.models.llava_next.anyres import anyres_cap
from mm_serve.models.model_config import (
    TEXT_MODEL_TYPES,
    CheckpointError,
    ModelConfig,
    TextConfig,
    VisionConfig,
    eos_ids,
    parse_text_config,
    parse_vision_config,
)

Parsed = tuple[TextConfig, VisionConfig | None]


def _parse_llava(raw: dict[str, Any], model_dir: Path) -> Parsed:
    """A llava-hf config: its ``text_config`` decoder and its tower and projector keys."""
    text = parse_text_config(dict(raw.get("text_config") or {}))
    if raw.get("tie_word_embeddings") is not None and "tie_word_embeddings" not in (raw.get("text_config") or {}):
        text = replace(text, tie_word_embeddings=bool(raw["tie_word_embeddings"]))
    return text, parse_vision_config(raw)


def _parse_llava_next(raw: dict[str, Any], model_dir: Path) -> Parsed:
    """A llava-hf LLaVA-NeXT config: a llava config plus ``image_grid_pinpoints``.

    Raises:
        CheckpointError: no pinpoints, or the ``full`` strategy on a tower with a class token (its
            tiles' features would not form a square grid).
    """
    text, vision = _parse_llava(raw, model_dir)
    assert vision is not None
    pinpoints = raw.get("image_grid_pinpoints") or []
    if not pinpoints or any(len(p) != 2 for p in pinpoints):
        raise CheckpointError("a LLaVA-NeXT config needs image_grid_pinpoints, a list of [height, width]")
    if vision.class_token and vision.select_strategy != "default":
        raise CheckpointError("LLaVA-NeXT with a class-token tower needs vision_feature_select_strategy 'default'")
    return text, replace(vision, grid_pinpoints=tuple((int(h), int(w)) for h, w in pinpoints))


def _parse_llava_onevision(raw: dict[str, Any], model_dir: Path) -> Parsed:
    """A llava-hf LLaVA-OneVision config: a LLaVA-NeXT config plus ``vision_aspect_ratio``
    (``anyres_max_N``: the grid features an image keeps are pooled to about N tiles' worth), and
    the rule that images sharing a prompt are not tiled.

    Raises:
        CheckpointError: as :func:`_parse_llava_next`, or a ``vision_aspect_ratio`` other than ``anyres_max_N``.
    """
    text, vision = _parse_llava_next(raw, model_dir)
    assert vision is not None
    try:
        cap = anyres_cap(str(raw.get("vision_aspect_ratio", "anyres_max_9")))
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    return text, replace(vision, max_num_patches=cap, multi_image_untiled=True)


def _parse_fast_vlm(raw: dict[str, Any], model_dir: Path) -> Parsed:
    """A FastVLM config: a llava config whose tower is a timm model (``timm_wrapper``, FastViTHD),
    read at its last feature map (layer -1, strategy ``full``). Each image makes ``image_seq_length``
    tokens, a square grid; the tower's input size is the image processor's crop
    (``preprocessor_config.json``), so its patch is that size over the grid's side.

    Raises:
        CheckpointError: another tower, layer or strategy; a token count that is not a square
            dividing the input size; no readable crop size.
    """
    text, vision = _parse_llava(raw, model_dir)
    assert vision is not None
    if vision.tower != "timm_wrapper" or vision.feature_layers != (-1,) or vision.select_strategy != "full":
        raise CheckpointError("FastVLM needs a timm_wrapper tower read at layer -1 with strategy 'full'")
    tokens = int(raw.get("image_seq_length", 0))
    side = math.isqrt(tokens)
    processor = Path(model_dir) / "preprocessor_config.json"
    try:
        pre = json.loads(processor.read_text())
        crop = pre.get("crop_size") or pre.get("size") or {}
        size = int(crop.get("height") or crop.get("shortest_edge") or 0)
    except (OSError, json.JSONDecodeError, TypeError, ValueError, AttributeError):
        size = 0
    if size < 1:
        raise CheckpointError(f"{processor}: no readable crop_size (the timm tower's input size)")
    if tokens < 1 or side * side != tokens or size % side:
        raise CheckpointError(f"image_seq_length {tokens} is not a square grid dividing the {size} px input")
    return text, replace(vision, image_size=size, patch_size=size // side)


QWEN_VL_TEXT = {"qwen2_vl": "qwen2_vl_text", "qwen2_5_vl": "qwen2_5_vl_text"}


def _parse_qwen2_vl(raw: dict[str, Any], model_dir: Path) -> Parsed:
    """A Qwen2-VL or Qwen2.5-VL config: a Qwen2 decoder with M-RoPE (``text_config``, or the top level as
    transformers 4.x wrote it) and a ViT with 2-D rotary positions whose merger emits the decoder's
    tokens; the patch size, merge size and pixel bounds from ``preprocessor_config.json``.

    Raises:
        CheckpointError: no ``mrope_section``, no image token id, or an unreadable preprocessor config.
    """
    text_raw = dict(raw.get("text_config") or {k: v for k, v in raw.items() if k not in ("vision_config",)})
    text_raw["model_type"] = QWEN_VL_TEXT.get(str(raw.get("model_type")), "qwen2_vl_text")
    if raw.get("tie_word_embeddings") is not None and "tie_word_embeddings" not in (raw.get("text_config") or {}):
        text_raw["tie_word_embeddings"] = raw["tie_word_embeddings"]
    text = parse_text_config(text_raw)
    if sum(text.rope.mrope_section) != text.head_dim // 2:
        raise CheckpointError(f"a Qwen2-VL decoder needs rope mrope_section summing to head_dim / 2 = {text.head_dim // 2}, "
                              f"got {list(text.rope.mrope_section)}")
    vcfg = dict(raw.get("vision_config") or {})
    image_token = raw.get("image_token_id", raw.get("image_token_index"))
    if image_token is None:
        raise CheckpointError("a Qwen2-VL config needs image_token_id")
    processor = model_dir / "preprocessor_config.json"
    try:
        prep = json.loads(processor.read_text())
        size = prep.get("size") or {}
        bounds = (int(prep.get("min_pixels", size.get("shortest_edge", 56 * 56))),
                  int(prep.get("max_pixels", size.get("longest_edge", 28 * 28 * 1280))))
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{processor}: cannot read the pixel bounds ({exc})") from None
    patch, merge = int(prep.get("patch_size", vcfg.get("patch_size", 14))), int(prep.get("merge_size", vcfg.get("spatial_merge_size", 2)))
    if not 0 < bounds[0] <= bounds[1] or bounds[1] < (patch * merge) ** 2:
        raise CheckpointError(f"{processor}: pixel bounds {bounds} must hold at least one {patch * merge} px square")
    tower = "qwen2_5_vl_vision" if vcfg.get("model_type", raw.get("model_type")) in ("qwen2_5_vl_vision", "qwen2_5_vl") \
        else "qwen2_vl_vision"
    vision = VisionConfig(
        hf_config=vcfg, tower=tower, class_token=False, image_size=patch * merge, patch_size=patch,
        hidden_size=int(vcfg.get("out_hidden_size") or vcfg.get("hidden_size") or text.hidden_size),
        image_token_index=int(image_token), feature_layers=(-1,), feature_layer_is_list=False, select_strategy="full",
        projector_hidden_act="gelu", projector_bias=True, merge_size=merge, pixel_bounds=bounds,
        video_token_index=None if raw.get("video_token_id") is None else int(raw["video_token_id"]),
        temporal_patch_size=int(prep.get("temporal_patch_size", vcfg.get("temporal_patch_size", 2))),
        # Qwen2.5-VL spaces a video's temporal positions by time (transformers' default 4 per second)
        tokens_per_second=float(vcfg.get("tokens_per_second", 4)) if tower == "qwen2_5_vl_vision" else 0.0,
    )
    return text, vision


def _parse_decoder(raw: dict[str, Any], model_dir: Path) -> Parsed:
    """A text-only decoder's config."""
    return parse_text_config(raw), None


@dataclass(frozen=True)
class ModelFamily:
    """One family of checkpoints.

    Attributes:
        name: the family's name (``ModelConfig.model_type`` of its checkpoints).
        architectures: the ``config.json`` ``architectures`` it serves.
        model_types: the ``model_type`` values it serves when ``architectures`` is absent.
        parse: ``config.json`` (a dict) and the checkpoint folder -> (decoder config, vision config or None).
        reference: transformers' class name the family's outputs are tested against.
    """

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    parse: Callable[[dict[str, Any], Path], Parsed]
    reference: str


FAMILIES: Final = (
    ModelFamily("llava", ("LlavaForConditionalGeneration",), ("llava",), _parse_llava, "LlavaForConditionalGeneration"),
    ModelFamily("llava_next", ("LlavaNextForConditionalGeneration",), ("llava_next",), _parse_llava_next,
                "LlavaNextForConditionalGeneration"),
    ModelFamily("llava_onevision", ("LlavaOnevisionForConditionalGeneration",), ("llava_onevision",),
                _parse_llava_onevision, "LlavaOnevisionForConditionalGeneration"),
    ModelFamily("fast_vlm", ("FastVlmForConditionalGeneration",), ("fast_vlm",), _parse_fast_vlm,
                "FastVlmForConditionalGeneration"),
    ModelFamily("qwen2_vl", ("Qwen2VLForConditionalGeneration",), ("qwen2_vl",), _parse_qwen2_vl,
                "Qwen2VLForConditionalGeneration"),
    ModelFamily("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",), ("qwen2_5_vl",), _parse_qwen2_vl,
                "Qwen2_5_VLForConditionalGeneration"),
    ModelFamily("decoder", ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"), TEXT_MODEL_TYPES,
                _parse_decoder, "AutoModelForCausalLM"),
)
BY_ARCHITECTURE: Final = MappingProxyType({arch: f for f in FAMILIES for arch in f.architectures})
BY_MODEL_TYPE: Final = MappingProxyType({mtype: f for f in FAMILIES for mtype in f.model_types})


def family_of(raw: dict[str, Any]) -> ModelFamily:
    """The family serving a checkpoint whose ``config.json`` is ``raw``.

    Raises:
        CheckpointError: an architecture (or model type) no family serves; the message lists those served.
    """
    architectures = raw.get("architectures") or []
    family = BY_ARCHITECTURE.get(str(architectures[0])) if architectures else BY_MODEL_TYPE.get(str(raw.get("model_type")))
    if family is None:
        what = f"architecture {architectures[0]!r}" if architectures else f"model_type {raw.get('model_type')!r}"
        raise CheckpointError(f"{what} is not supported; supported architectures: {', '.join(BY_ARCHITECTURE)}")
    return family


def _check_declared_dtype(raw: dict[str, Any], path: Path) -> None:
    """Refuse a ``dtype`` / ``torch_dtype`` (top level or ``text_config``) that names no torch element type:
    transformers would fail on it later with a bare AttributeError.

    Raises:
        CheckpointError: the value is not the name of a ``torch.dtype`` (``float16``, ``bfloat16``, ...) or ``auto``.
    """
    import torch

    for key, value in declared_dtypes(raw):
        if value != "auto" and (not isinstance(value, str) or not isinstance(getattr(torch, value, None), torch.dtype)):
            raise CheckpointError(f"{path}: {key} {value!r} is not a torch element type "
                                  "(such as float32, bfloat16, float16)")


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read ``model_dir/config.json`` through its family (and ``generation_config.json`` for EOS ids).

    Raises:
        CheckpointError: no config.json, invalid JSON, a declared dtype that is no torch type, or an
            unsupported architecture.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json (not a model directory)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON: {exc}") from None
    _check_declared_dtype(raw, path)
    try:
        family = family_of(raw)
        text, vision = family.parse(raw, Path(model_dir))
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        gen_eos = eos_ids(json.loads(gen_path.read_text()).get("eos_token_id"))
        if gen_eos:
            text = replace(text, eos_token_ids=tuple(dict.fromkeys(text.eos_token_ids + gen_eos)))
    model_type = family.name if family.name != "decoder" else str(raw.get("model_type", "llama"))
    return ModelConfig(model_type=model_type, text=text, vision=vision, raw=raw)
