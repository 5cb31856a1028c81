"""Model configs (as their hub checkpoints ship them) and small factories."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

OPT_13B: dict[str, Any] = {
    "_name_or_path": "facebook/opt-13b", "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "do_layer_norm_before": True, "ffn_dim": 20480,
    "hidden_size": 5120, "max_position_embeddings": 2048, "model_type": "opt",
    "num_attention_heads": 40, "num_hidden_layers": 40, "torch_dtype": "float16",
    "vocab_size": 50272, "word_embed_proj_dim": 5120,
}
LLAMA_2_7B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "tie_word_embeddings": False, "torch_dtype": "float16", "vocab_size": 32000,
}
# llava-hf/llava-1.5-7b-hf: a partial text_config, the rest are LlamaConfig defaults.
LLAVA_HF_7B: dict[str, Any] = {
    "architectures": ["LlavaForConditionalGeneration"], "image_token_index": 32000,
    "model_type": "llava", "projector_hidden_act": "gelu",
    "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                    "max_position_embeddings": 4096, "model_type": "llama",
                    "torch_dtype": "float16", "vocab_size": 32064},
    "tie_word_embeddings": False, "torch_dtype": "float16",
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
}
# liuhaotian/llava-v1.5-7b: Llama fields at top level plus mm_* keys.
LLAVA_ORIGINAL_7B: dict[str, Any] = {
    **LLAMA_2_7B, "model_type": "llava", "architectures": ["LlavaLlamaForCausalLM"],
    "mm_hidden_size": 1024, "mm_projector_type": "mlp2x_gelu", "mm_vision_select_feature": "patch",
    "mm_vision_select_layer": -2, "mm_vision_tower": "openai/clip-vit-large-patch14-336",
}
TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 512, "intermediate_size": 1376,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
    "vocab_size": 32000, "max_position_embeddings": 2048, "torch_dtype": "float32",
}


def write_config(directory: Path, config: dict[str, Any]) -> Path:
    """Write ``config`` as ``directory/config.json`` and return the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _named() -> dict[str, dict[str, Any]]:
    named = {"opt-13b": OPT_13B, "llama-2-7b": LLAMA_2_7B, "llava-hf": LLAVA_HF_7B,
             "llava-original": LLAVA_ORIGINAL_7B, "tiny-llama": TINY_LLAMA}
    return {k: json.loads(json.dumps(v)) for k, v in named.items()}


@pytest.fixture
def configs() -> dict[str, dict[str, Any]]:
    """Fresh copies of the configs above by name (opt-13b, llama-2-7b, llava-hf,
    llava-original, tiny-llama)."""
    return _named()


@pytest.fixture(scope="module")
def module_configs() -> dict[str, dict[str, Any]]:
    """The same copies, shared by a module's expensive fixtures (do not mutate)."""
    return _named()


@pytest.fixture
def opt13b_dir(tmp_path: Path) -> Path:
    return write_config(tmp_path / "opt-13b", OPT_13B)


@pytest.fixture
def llava_dir(tmp_path: Path) -> Path:
    return write_config(tmp_path / "llava-1.5-7b-hf", LLAVA_HF_7B)
