"""Model shapes read from a Hugging Face ``config.json`` (OPT, Llama-family, LLaVA).

Only what the latency model needs: layer count, widths, heads, vocabulary, context,
the element size, and for a multimodal model the vision tower's shape and how many
LLM tokens one image becomes. Keys a config omits take the defaults of its
``model_type`` in transformers (llava-hf checkpoints store a partial ``text_config``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from mm_serve.ground.dtypes import DTYPE_BYTES
from mm_serve.planner.errors import ModelShapeError
from mm_serve.planner.vision_shape import VisionShape, vision_from_hf, vision_from_tower_name

# transformers' config defaults for types whose checkpoints may omit fields.
_TEXT_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "llama": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "vocab_size": 32000, "max_position_embeddings": 2048},
    "mistral": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
                "max_position_embeddings": 4096 * 32},
    "qwen2": {"hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 151936,
              "max_position_embeddings": 32768},
    "opt": {"hidden_size": 768, "ffn_dim": 3072, "num_hidden_layers": 12,
            "num_attention_heads": 12, "vocab_size": 50272, "max_position_embeddings": 2048},
})
_NON_GATED_TYPES = frozenset({"opt", "gpt2", "gpt_neox", "gptj", "bloom", "falcon", "bert"})
_ALIASES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "intermediate_size": ("intermediate_size", "ffn_dim", "n_inner"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "max_seq_len"),
})
_DTYPE_BYTES = MappingProxyType({**DTYPE_BYTES, "float": 4})  # "float": an old transformers name of float32


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only LLM (plus optional vision tower). Counts are plain numbers."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int  # tokens
    gated_mlp: bool  # SwiGLU (3 matrices) vs plain MLP (2)
    tied_embeddings: bool
    learned_positions: bool  # OPT / GPT-2 position table
    dtype: str  # element type of weights and KV: float16, bfloat16 or float32
    dtype_bytes: int
    vision: VisionShape | None = None

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer (attention + MLP; norms and biases ignored)."""
        h = self.hidden_size
        attn = 2 * h * self.q_dim + 2 * h * self.kv_dim
        return attn + (3 if self.gated_mlp else 2) * h * self.intermediate_size

    @property
    def embedding_params(self) -> int:
        """Token (and position) embeddings plus an untied LM head."""
        table = self.vocab_size * self.hidden_size
        pos = self.max_context * self.hidden_size if self.learned_positions else 0
        return table * (1 if self.tied_embeddings else 2) + pos

    @property
    def llm_params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params

    @property
    def params(self) -> int:
        """All weights, vision tower and projector included."""
        return self.llm_params + (self.vision.params if self.vision else 0)

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers, bytes (DistServe §3: KV hand-off size)."""
        return 2 * self.num_layers * self.kv_dim * self.dtype_bytes

    @property
    def image_tokens(self) -> int:
        """LLM tokens per image (0 for a text-only model)."""
        return self.vision.image_tokens if self.vision else 0


def _get(cfg: Mapping[str, Any], key: str, defaults: Mapping[str, Any]) -> Any:
    for alias in _ALIASES.get(key, (key,)):
        if alias in cfg and cfg[alias] is not None:
            return cfg[alias]
    for alias in _ALIASES.get(key, (key,)):
        if alias in defaults:
            return defaults[alias]
    return None


def _positive_int(value: Any, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelShapeError(f"{where}: '{key}' must be a positive integer, got {value!r}")
    return value


def _dtype(where: str, *configs: Mapping[str, Any]) -> dict[str, Any]:
    """``dtype`` and ``dtype_bytes`` from the config's ``torch_dtype`` (default float16).

    Raises:
        ModelShapeError: a ``torch_dtype`` the planner has no size for (float8 or
            integer checkpoints, a typo): guessing 2 bytes would misplan memory.
    """
    for cfg in configs:
        key = "torch_dtype" if cfg.get("torch_dtype") is not None else "dtype"
        name = cfg.get(key)
        if name is None:
            continue
        if not isinstance(name, str) or name not in _DTYPE_BYTES:
            raise ModelShapeError(f"{where}: '{key}' {name!r} is not supported "
                                  "(float16, bfloat16 or float32)")
        return {"dtype": "float32" if name == "float" else name, "dtype_bytes": _DTYPE_BYTES[name]}
    return {"dtype": "float16", "dtype_bytes": 2}


def _text_shape(cfg: Mapping[str, Any], name: str, where: str) -> dict[str, Any]:
    mtype = cfg.get("model_type", "llama")
    if not isinstance(mtype, str):
        raise ModelShapeError(f"{where}: 'model_type' must be a string, got {mtype!r}")
    defaults = _TEXT_DEFAULTS.get(mtype, {})
    if not defaults:  # every field must then be in the file
        where = f"{where} (model_type {mtype!r} has no known defaults)"
    hidden = _positive_int(_get(cfg, "hidden_size", defaults), "hidden_size", where)
    heads = _positive_int(_get(cfg, "num_attention_heads", defaults), "num_attention_heads", where)
    kv_value = cfg.get("num_key_value_heads")
    kv = _positive_int(defaults.get("num_key_value_heads", heads) if kv_value is None else kv_value,
                       "num_key_value_heads", where)
    head_dim = cfg.get("head_dim")
    if head_dim is None and hidden < heads:
        raise ModelShapeError(f"{where}: 'hidden_size' {hidden} is smaller than "
                              f"'num_attention_heads' {heads} (head size 0)")
    if head_dim is None and hidden % heads:
        raise ModelShapeError(f"{where}: 'hidden_size' {hidden} is not divisible by "
                              f"'num_attention_heads' {heads} (give 'head_dim')")
    if heads % kv:
        raise ModelShapeError(f"{where}: {heads} attention heads not divisible by {kv} KV heads")
    inter = _get(cfg, "intermediate_size", defaults)
    inter = 4 * hidden if inter is None else inter
    fields: dict[str, Any] = {
        "name": name, "model_type": mtype,
        "num_layers": _positive_int(_get(cfg, "num_hidden_layers", defaults), "num_hidden_layers", where),
        "hidden_size": hidden, "num_heads": heads,
        "num_kv_heads": kv,
        "head_dim": _positive_int(hidden // heads if head_dim is None else head_dim, "head_dim", where),
        "intermediate_size": _positive_int(inter, "intermediate_size", where),
        "vocab_size": _positive_int(_get(cfg, "vocab_size", defaults), "vocab_size", where),
        "max_context": _positive_int(_get(cfg, "max_position_embeddings", defaults) or 2048,
                                     "max_position_embeddings", where),
        "gated_mlp": mtype not in _NON_GATED_TYPES,
        "tied_embeddings": bool(cfg.get("tie_word_embeddings", mtype == "opt")),
        "learned_positions": mtype in ("opt", "gpt2"),
    }
    return fields


def shape_from_config(cfg: Mapping[str, Any], name: str = "model", where: str = "config") -> ModelShape:
    """Build a :class:`ModelShape` from a parsed config.json (any supported layout).

    Raises:
        ModelShapeError: a required field is missing or not a positive integer, or
            the element type is not float16, bfloat16 or float32.
    """
    if not isinstance(cfg, Mapping):
        raise ModelShapeError(f"{where}: top level must be a JSON object")
    for key in ("text_config", "vision_config"):
        if cfg.get(key) is not None and not isinstance(cfg[key], Mapping):
            raise ModelShapeError(f"{where}: '{key}' must be a JSON object, got {cfg[key]!r}")
    if cfg.get("mm_vision_tower") is not None and not isinstance(cfg["mm_vision_tower"], str):
        raise ModelShapeError(f"{where}: 'mm_vision_tower' must be a model name, got "
                              f"{cfg['mm_vision_tower']!r}")
    text_cfg = cfg.get("text_config")
    if isinstance(text_cfg, Mapping):  # llava-hf layout
        fields = _text_shape({"model_type": "llama", **text_cfg}, name, f"{where}: text_config")
        vision_cfg = cfg.get("vision_config")
        vision = None
        if isinstance(vision_cfg, Mapping):
            vision = vision_from_hf(cfg, vision_cfg, fields["hidden_size"], where)
        fields["model_type"] = str(cfg.get("model_type", "llava"))
        return ModelShape(**fields, **_dtype(where, cfg, text_cfg), vision=vision)
    fields = _text_shape(cfg, name, where)
    tower = cfg.get("mm_vision_tower")
    vision = None
    if isinstance(tower, str):  # original LLaVA (liuhaotian) layout
        vision = vision_from_tower_name(tower, cfg, fields["hidden_size"], where)
    elif isinstance(cfg.get("vision_config"), Mapping):  # Qwen2-VL as transformers 4.x wrote it: text at the top
        vision = vision_from_hf(cfg, cfg["vision_config"], fields["hidden_size"], where)
    if fields["model_type"].startswith("llava"):
        fields["model_type"] = "llava"
        fields["gated_mlp"] = True
    return ModelShape(**fields, **_dtype(where, cfg), vision=vision)


def load_model_shape(path: str | Path) -> ModelShape:
    """Read a model directory (its ``config.json``) or a bare config.json file.

    Raises:
        ModelShapeError: the file is missing, not JSON, or not a usable config.
    """
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise ModelShapeError(f"no config.json at {p}")
    try:
        cfg = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelShapeError(f"{file}: not valid JSON: {exc}") from None
    name = p.name if p.is_dir() else (p.parent.name or p.stem)
    if isinstance(cfg, Mapping) and isinstance(cfg.get("_name_or_path"), str):
        name = re.sub(r".*/", "", cfg["_name_or_path"]) or name
    return shape_from_config(cfg, name=name, where=str(file))
