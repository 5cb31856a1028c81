"""Build small random-weight checkpoints for tests and benchmarks, from a seed, offline.

Two kinds, both in the format real checkpoints use, so they load through the
same code path as any downloaded model:

* ``llava``: a llava-hf ``LlavaForConditionalGeneration`` directory (Llama text
  model, CLIP vision tower, projector, tokenizer + chat template,
  ``preprocessor_config.json``);
* ``llama``: a plain ``LlamaForCausalLM`` directory.

Weights are drawn by transformers' own initialisers under ``torch.manual_seed``;
``initializer_range`` is larger than usual so that random models have peaked
next-token distributions (greedy choices are then far from ties).

Command line: ``python -m mm_serve.models.builder {llava,llama,bench} --out DIR [--seed S]``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mm_serve.models.tokenizer_builder import build_tokenizer


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of a generated checkpoint. Defaults give a ~1 M-parameter test model."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    initializer_range: float = 0.1
    # Vision tower (llava only).
    image_size: int = 56
    patch_size: int = 14
    vision_hidden_size: int = 64
    vision_intermediate_size: int = 128
    vision_layers: int = 2
    vision_heads: int = 2
    vision_feature_layer: int | list[int] = -2
    vision_feature_select_strategy: str = "default"
    image_mean: list[float] = field(default_factory=lambda: [0.48145466, 0.4578275, 0.40821073])
    image_std: list[float] = field(default_factory=lambda: [0.26862954, 0.26130258, 0.27577711])
    center_crop: bool = True
    tokenizer_style: str = "bytelevel"  # or "llama": adds BOS itself, template without BOS (tokenizer_builder)


# A benchmark preset: large enough that prefill and decode cost real compute on a 2-core CPU.
BENCH_SPEC = TinyModelSpec(
    vocab_size=2048, hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8,
    num_kv_heads=4, initializer_range=0.05, image_size=224, patch_size=16, vision_hidden_size=256,
    vision_intermediate_size=1024, vision_layers=4, vision_heads=4,
)


def _text_config(spec: TinyModelSpec, tokenizer_vocab: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=max(spec.vocab_size, tokenizer_vocab),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,  # type: ignore[call-arg]  # transformers 5 folds it into rope_parameters
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )


def _preprocessor_config(spec: TinyModelSpec) -> dict[str, Any]:
    size: dict[str, int] = (
        {"shortest_edge": spec.image_size} if spec.center_crop
        else {"height": spec.image_size, "width": spec.image_size}
    )
    return {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": True,
        "size": size,
        "resample": 3,
        "do_center_crop": spec.center_crop,
        "crop_size": {"height": spec.image_size, "width": spec.image_size},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": spec.image_mean,
        "image_std": spec.image_std,
        "do_convert_rgb": True,
    }


def build_llama(out_dir: str | Path, seed: int = 0, spec: TinyModelSpec | None = None) -> Path:
    """Write a random-weight text-only Llama checkpoint to ``out_dir``; returns the path."""
    import torch
    from transformers import LlamaForCausalLM

    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out, spec.vocab_size, style=spec.tokenizer_style)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_text_config(spec, vocab))
    model.save_pretrained(out)
    _write_spec(out, spec, seed, "llama")
    return out


def build_llava(out_dir: str | Path, seed: int = 0, spec: TinyModelSpec | None = None) -> Path:
    """Write a random-weight llava-hf checkpoint to ``out_dir``; returns the path."""
    import torch
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out, spec.vocab_size, style=spec.tokenizer_style)
    vision = CLIPVisionConfig(
        hidden_size=spec.vision_hidden_size,
        intermediate_size=spec.vision_intermediate_size,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        initializer_range=spec.initializer_range,
    )
    config = LlavaConfig(
        text_config=_text_config(spec, vocab),
        vision_config=vision,
        image_token_index=4,  # "<image>" in tokenizer_builder.SPECIAL_TOKENS
        vision_feature_layer=spec.vision_feature_layer,
        vision_feature_select_strategy=spec.vision_feature_select_strategy,  # type: ignore[arg-type]
        projector_hidden_act="gelu",
        image_seq_length=(spec.image_size // spec.patch_size) ** 2,
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(_preprocessor_config(spec), indent=2))
    _write_spec(out, spec, seed, "llava")
    return out


def _write_spec(out: Path, spec: TinyModelSpec, seed: int, kind: str) -> None:
    (out / "mm_serve_build.json").write_text(json.dumps({"kind": kind, "seed": seed, **asdict(spec)}, indent=2))


def main(argv: list[str] | None = None) -> int:
    """CLI: build a checkpoint; prints its path."""
    parser = argparse.ArgumentParser(prog="python -m mm_serve.models.builder", description=__doc__)
    parser.add_argument("kind", choices=["llava", "llama", "bench", "bench-llama"])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.kind == "llava":
        path = build_llava(args.out, args.seed)
    elif args.kind == "llama":
        path = build_llama(args.out, args.seed)
    elif args.kind == "bench":
        path = build_llava(args.out, args.seed, BENCH_SPEC)
    else:
        path = build_llama(args.out, args.seed, BENCH_SPEC)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
