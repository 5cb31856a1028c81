"""Reading config.json of OPT, Llama, llava-hf and original LLaVA into a model shape."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mm_serve.planner.errors import ModelShapeError
from mm_serve.planner.model_shape import load_model_shape, shape_from_config

Configs = dict[str, dict[str, Any]]


def test_opt_13b_shape_and_parameter_count(opt13b_dir: Path) -> None:
    shape = load_model_shape(opt13b_dir)
    assert shape.name == "opt-13b"
    assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads) == (40, 5120, 40, 40)
    assert shape.intermediate_size == 20480 and not shape.gated_mlp and shape.tied_embeddings
    assert shape.layer_params == 4 * 5120**2 + 2 * 5120 * 20480
    assert shape.params == 40 * shape.layer_params + 50272 * 5120 + 2048 * 5120 == 12_850_790_400
    assert shape.kv_bytes_per_token == 2 * 40 * 5120 * 2 == 819_200
    assert shape.dtype == "float16" and shape.dtype_bytes == 2 and shape.vision is None


def test_bare_config_json_and_llama(tmp_path: Path, configs: Configs) -> None:
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(configs["llama-2-7b"]))
    shape = load_model_shape(path)
    assert shape.gated_mlp and not shape.tied_embeddings
    assert shape.params == 6_738_149_376  # Llama-2-7B
    assert shape.max_context == 4096 and shape.head_dim == 128


def test_grouped_query_attention_shrinks_kv(configs: Configs) -> None:
    shape = shape_from_config({**configs["llama-2-7b"], "num_key_value_heads": 8})
    assert shape.kv_dim == 8 * 128
    assert shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_llava_hf_partial_text_config_uses_llama_defaults(llava_dir: Path) -> None:
    shape = load_model_shape(llava_dir)
    assert shape.model_type == "llava"
    assert (shape.num_layers, shape.hidden_size, shape.intermediate_size) == (32, 4096, 11008)
    assert shape.vocab_size == 32064
    vis = shape.vision
    assert vis is not None
    assert vis.num_layers == 23  # feature layer -2 of 24
    assert vis.seq_len == 577 and shape.image_tokens == 576  # CLS dropped ("default")
    assert vis.projector_params == 1024 * 4096 + 4096 * 4096
    full = shape_from_config({**json.loads((llava_dir / "config.json").read_text()),
                              "vision_feature_select_strategy": "full"})
    assert full.image_tokens == 577


def test_original_llava_tower_name(configs: Configs) -> None:
    shape = shape_from_config(configs["llava-original"])
    assert shape.vision is not None
    assert (shape.vision.image_size, shape.vision.patch_size, shape.vision.num_layers) == (336, 14, 23)
    assert shape.image_tokens == 576
    assert shape.vision.projector_params == 1024 * 4096 + 4096 * 4096


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "top level must be a JSON object"),
        ({"name": "opt-13b", "hidden_size": "big"}, "'hidden_size' must be a positive integer"),
        ({"name": "llama-2-7b", "num_key_value_heads": 5}, "not divisible by 5 KV heads"),
        ({"name": "llama-2-7b", "torch_dtype": "float8_e4m3fn"}, "'torch_dtype' 'float8_e4m3fn' is not supported"),
        ({"name": "opt-13b", "torch_dtype": None, "dtype": "flaot16"}, "'dtype' 'flaot16' is not supported"),
        ({"name": "llama-2-7b", "model_type": "mamba", "hidden_size": None},
         "model_type 'mamba' has no known defaults.*'hidden_size' must be a positive integer"),
        ({"name": "llama-2-7b", "model_type": 5}, "'model_type' must be a string"),
        ({"name": "llama-2-7b", "hidden_size": 16}, "'hidden_size' 16 is smaller than 'num_attention_heads' 32"),
        ({"name": "llama-2-7b", "num_key_value_heads": 0}, "'num_key_value_heads' must be a positive integer, got 0"),
        ({"name": "llama-2-7b", "intermediate_size": 0}, "'intermediate_size' must be a positive integer, got 0"),
        ({"name": "llama-2-7b", "head_dim": 0}, "'head_dim' must be a positive integer, got 0"),
        ({"name": "llama-2-7b", "hidden_size": 4097}, "'hidden_size' 4097 is not divisible by"),
        ({"name": "llava-hf", "vision_feature_layer": "x"}, "'vision_feature_layer' must be a layer index"),
        ({"name": "llava-hf", "vision_config": {"image_size": 336, "patch_size": 1000}},
         "image_size 336 is smaller than its patch_size 1000: no image tokens"),
        ({"name": "llava-hf", "vision_feature_select_strategy": "weird"}, "must be one of default, full"),
        ({"name": "llava-original", "mm_hidden_size": "abc"}, "vision 'mm_hidden_size' must be a positive"),
        ({"name": "llava-original", "mm_vision_tower": "foo/bar"}, "cannot tell the patch size"),
        ({"name": "llava-original", "mm_vision_tower": "openai/clip-vit-large-patch0-336"},
         "'patch size' must be a positive integer"),
        ({"name": "llava-original", "mm_vision_select_layer": -100}, "'mm_vision_select_layer' must be"),
        ({"name": "llava-original", "mm_vision_select_feature": "all"}, "must be one of patch, cls_patch"),
        ({"name": "llava-original", "mm_projector_type": "mlp0x_gelu"}, "has 0 layers"),
        ({"name": "llava-original", "mm_vision_tower": 5}, "'mm_vision_tower' must be a model name"),
        ({"name": "llava-hf", "vision_config": "clip"}, "'vision_config' must be a JSON object"),
        ({"name": "llava-hf", "text_config": [1]}, "'text_config' must be a JSON object"),
    ],
)
def test_malformed_configs_raise_clear_errors(
    tmp_path: Path, configs: Configs, content: str | dict[str, Any], message: str
) -> None:
    if isinstance(content, dict):
        base = configs[str(content.pop("name"))]
        content = json.dumps({**base, **content})
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ModelShapeError, match=message):
        load_model_shape(path)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelShapeError, match="no config.json"):
        load_model_shape(tmp_path / "nowhere")


def test_element_type_from_torch_dtype_or_dtype(configs: Configs) -> None:
    """transformers writes ``torch_dtype`` (older) or ``dtype`` (4.56 on); no key: float16."""
    llama = {k: v for k, v in configs["llama-2-7b"].items() if k != "torch_dtype"}
    assert shape_from_config({**llama, "dtype": "float32"}).dtype_bytes == 4
    assert shape_from_config({**llama, "dtype": "bfloat16"}).dtype == "bfloat16"
    assert (shape_from_config(llama).dtype, shape_from_config(llama).dtype_bytes) == ("float16", 2)


# llava-hf/llava-v1.6-vicuna-7b-hf's vision keys (its text_config is vicuna's, as LLAVA_HF_7B's).
NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]


def test_llava_next_plans_the_costliest_image(configs: Configs) -> None:
    """A LLaVA-NeXT image is planned at the largest grid: 2x2 tiles plus the whole image (5 tower
    passes), 48x48 grid features with a newline per row plus the 576 base tokens = 2928 tokens,
    transformers' ``LlavaNextProcessor`` count for a 672x672 image."""
    shape = shape_from_config({**configs["llava-hf"], "model_type": "llava_next",
                               "architectures": ["LlavaNextForConditionalGeneration"],
                               "image_grid_pinpoints": NEXT_PINPOINTS})
    assert shape.vision is not None
    assert (shape.vision.tiles_per_image, shape.image_tokens) == (5, 48 * 48 + 48 + 576)
    assert shape.vision.seq_len == 577 and shape.vision.pass_tokens == 576  # per tower pass as before


@pytest.mark.parametrize("kind", ["llava-next", "llava-onevision"])
def test_tiling_checkpoints_plan_what_the_engine_sizes_for(kind: str, tmp_path: Path) -> None:
    """On the builder's checkpoints the planner's per-image tokens equal the most the engine's own
    config parser lets an image make (what the ring's feature rows are sized for), and its tower
    passes the largest grid's tiles plus one."""
    from mm_serve.models.llava_next.anyres import num_tiles
    from mm_serve.models.registry import load_model_config
    from tests.factories import build_checkpoint

    build_checkpoint(kind, tmp_path)
    vision = load_model_config(tmp_path).vision
    assert vision is not None and vision.grid_pinpoints
    shape = load_model_shape(tmp_path)
    assert shape.vision is not None
    assert shape.image_tokens == vision.max_image_tokens
    assert shape.vision.tiles_per_image == max(num_tiles((h, w), vision.grid_pinpoints, vision.image_size)
                                               for h, w in vision.grid_pinpoints)


@pytest.mark.parametrize("pinpoints, aspect, message", [
    ([[336]], None, "image_grid_pinpoints"),
    ([[100, 100]], None, "image_grid_pinpoints"),
    (NEXT_PINPOINTS, "pad", "anyres_max_N"),
])
def test_malformed_tiling_keys_raise(configs: Configs, pinpoints: Any, aspect: str | None, message: str) -> None:
    cfg = {**configs["llava-hf"], "model_type": "llava_onevision", "image_grid_pinpoints": pinpoints}
    if aspect is not None:
        cfg["vision_aspect_ratio"] = aspect
    with pytest.raises(ModelShapeError, match=message):
        shape_from_config(cfg)


# Qwen/Qwen2-VL-7B-Instruct's config.json as transformers 4.x wrote it: the decoder at the top level.
QWEN2_VL_7B: dict[str, Any] = {
    "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "hidden_size": 3584,
    "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "max_position_embeddings": 32768, "vocab_size": 152064, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "image_token_id": 151655, "tie_word_embeddings": False,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                      "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
}


@pytest.mark.parametrize("layout", ["4.x top level", "5.x text_config"])
def test_qwen2_vl_plans_a_photo_worth_of_merged_patches(layout: str) -> None:
    """Qwen2-VL's ViT (32 layers of 1280, 14 px patches merged 2x2) planned for a 1024 x 1024 image:
    1337 tokens from about 4 x 1337 patches in one pass, no class token; the decoder as Qwen2's."""
    from mm_serve.planner.vision_shape import QWEN_PLAN_PIXELS

    cfg = dict(QWEN2_VL_7B)
    if layout == "5.x text_config":
        text = {k: cfg.pop(k) for k in list(cfg) if k not in ("architectures", "model_type", "vision_config",
                                                             "image_token_id", "torch_dtype")}
        cfg["text_config"] = {**text, "model_type": "qwen2_vl_text"}
    shape = shape_from_config(cfg)
    assert (shape.num_layers, shape.hidden_size, shape.num_kv_heads) == (28, 3584, 4)
    vis = shape.vision
    assert vis is not None and (vis.num_layers, vis.hidden_size, vis.num_heads, vis.intermediate_size) == (32, 1280, 16, 5120)
    assert shape.image_tokens == QWEN_PLAN_PIXELS // 28**2 == 1337 and not vis.has_cls
    assert abs(vis.num_patches - 4 * 1337) < 4 * 1337 * 0.02
