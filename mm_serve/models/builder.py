"""Build small random-weight checkpoints for tests and benchmarks, from a seed, offline.

Two kinds, both in the format real checkpoints use, so they load through the
same code path as any downloaded model:

* ``llava``: a llava-hf ``LlavaForConditionalGeneration`` directory (Llama text
  model, CLIP vision tower, projector, tokenizer + chat template,
  ``preprocessor_config.json`` and ``processor_config.json``); ``llava-siglip`` with a SigLIP tower
  (``SiglipImageProcessor`` preprocessing), ``llava-qwen2`` with a Qwen2 decoder; ``llava-next`` a
  ``LlavaNextForConditionalGeneration`` one (any-resolution tiling); ``llava-onevision`` a
  ``LlavaOnevisionForConditionalGeneration`` one (SigLIP, Qwen2, tiles pooled to ``anyres_max_4``);
  ``fast-vlm`` a ``FastVlmForConditionalGeneration`` one (a timm FastViTHD tower, Qwen2);
* ``llama``: a plain ``LlamaForCausalLM`` directory; ``qwen2`` a ``Qwen2ForCausalLM`` one.

Weights are drawn by transformers' own initialisers under ``torch.manual_seed``;
``initializer_range`` is larger than usual so that random models have peaked
next-token distributions (greedy choices are then far from ties).

Command line: ``python -m mm_serve.models.builder {llava,llava-siglip,llava-qwen2,llava-next,llava-onevision,fast-vlm,qwen2-vl,qwen2.5-vl,llama,qwen2,bench,bench-next,bench-llama,bench-qwen2.5-vl}
--out DIR [--seed S]``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field, replace
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
    decoder: str = "llama"  # or "qwen2" (q/k/v biases, rope theta 1e6)
    # LLaVA-NeXT only: the (height, width) resolutions an image is tiled at, multiples of image_size
    grid_pinpoints: list[list[int]] = field(default_factory=lambda: [[56, 112], [112, 56], [112, 112], [56, 168],
                                                                     [168, 56]])
    vision_tower: str = "clip"  # or "siglip" (no class token; resize without crop, mean/std 0.5), "timm" (FastViTHD)
    # LLaVA-OneVision only: the grid features an image keeps are pooled to about N tiles' worth
    vision_aspect_ratio: str = "anyres_max_4"
    # Qwen2-VL only: (min_pixels, max_pixels) each image is resized within (28 px per merged token)
    pixel_bounds: tuple[int, int] = (28 * 28 * 4, 28 * 28 * 64)


# A benchmark preset: large enough that prefill and decode cost real compute on a 2-core CPU.
BENCH_SPEC = TinyModelSpec(
    vocab_size=2048, hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8,
    num_kv_heads=4, initializer_range=0.05, image_size=224, patch_size=16, vision_hidden_size=256,
    vision_intermediate_size=1024, vision_layers=4, vision_heads=4,
)


# The benchmark preset as LLaVA-NeXT: 224 px tiles (196 tokens each) on grids up to 2x2 and 1x3, so an
# image makes from about 300 to about 1,000 tokens by its shape
BENCH_NEXT_SPEC = replace(BENCH_SPEC, grid_pinpoints=[[224, 448], [448, 224], [448, 448], [224, 672], [672, 224]])


# LLaVA-OneVision's shape: SigLIP's last layer, every position kept ("full"), a Qwen2 decoder; tiles up
# to 4x4, pooled above anyres_max_4 so both a pooled and an unpooled grid occur among test images
ONEVISION_SPEC = TinyModelSpec(
    decoder="qwen2", rope_theta=1_000_000.0, vision_tower="siglip", vision_feature_layer=-1,
    vision_feature_select_strategy="full",
    grid_pinpoints=[[56, 56], [56, 112], [112, 56], [112, 112], [56, 224], [224, 56], [168, 168], [224, 224]],
)


# FastVLM's shape: a timm FastViTHD tower (stride 64, read at its last map, "full"), a Qwen2 decoder,
# CLIP-style resize and crop with FastVLM's mean 0 / std 1; 256 px -> 4x4 = 16 tokens per image
FAST_VLM_SPEC = TinyModelSpec(
    decoder="qwen2", rope_theta=1_000_000.0, vision_tower="timm", image_size=256, patch_size=64,
    vision_hidden_size=128, vision_feature_layer=-1, vision_feature_select_strategy="full",
    image_mean=[0.0, 0.0, 0.0], image_std=[1.0, 1.0, 1.0],
)


def _text_config(spec: TinyModelSpec, tokenizer_vocab: int) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    if spec.decoder not in ("llama", "qwen2"):
        raise ValueError(f"decoder must be llama or qwen2, got {spec.decoder!r}")
    config_class = Qwen2Config if spec.decoder == "qwen2" else LlamaConfig
    extra: dict[str, Any] = {"use_sliding_window": False} if spec.decoder == "qwen2" else {}
    return config_class(
        **extra,
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
    if spec.vision_tower == "siglip":  # SiglipImageProcessor: a square resize, no crop
        return {
            "image_processor_type": "SiglipImageProcessor", "do_resize": True,
            "size": {"height": spec.image_size, "width": spec.image_size}, "resample": 3, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True,
        }
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


def _processor_config(spec: TinyModelSpec) -> dict[str, Any]:
    """``processor_config.json`` of transformers' ``LlavaProcessor``: how many image tokens an image makes."""
    return {
        "processor_class": "LlavaProcessor", "image_token": "<image>", "patch_size": spec.patch_size,
        "vision_feature_select_strategy": spec.vision_feature_select_strategy,
        "num_additional_image_tokens": 1 if spec.vision_tower == "clip" else 0,
    }


def _vision_config(spec: TinyModelSpec) -> Any:
    """transformers' config of the spec's vision tower."""
    from transformers import CLIPVisionConfig, SiglipVisionConfig

    if spec.vision_tower == "timm":  # FastViTHD (timm's fastvit_mci3), one block per stage, narrow
        from transformers import TimmWrapperConfig

        widths = (16, 16, 32, 32, spec.vision_hidden_size // 2)  # its last stage doubles the width
        timm_args: dict[str, Any] = {
            "architecture": "fastvit_mci3", "hidden_size": spec.vision_hidden_size, "do_pooling": True,
            "global_pool": "avg", "initializer_range": spec.initializer_range,
            "model_args": {"inference_mode": True, "layers": (1, 1, 1, 1, 1), "embed_dims": widths},
        }
        return TimmWrapperConfig(**timm_args)
    if spec.vision_tower not in ("clip", "siglip"):
        raise ValueError(f"vision_tower must be clip, siglip or timm, got {spec.vision_tower!r}")
    sizes: dict[str, Any] = {"hidden_size": spec.vision_hidden_size, "intermediate_size": spec.vision_intermediate_size,
             "num_hidden_layers": spec.vision_layers, "num_attention_heads": spec.vision_heads,
             "image_size": spec.image_size, "patch_size": spec.patch_size}
    if spec.vision_tower == "siglip":
        return SiglipVisionConfig(**sizes, vision_use_head=False)
    return CLIPVisionConfig(**sizes, initializer_range=spec.initializer_range)


def build_llama(out_dir: str | Path, seed: int = 0, spec: TinyModelSpec | None = None) -> Path:
    """Write a random-weight text-only decoder checkpoint (Llama, or Qwen2 with ``spec.decoder``) to
    ``out_dir``; returns the path."""
    import torch
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out, spec.vocab_size, style=spec.tokenizer_style)
    torch.manual_seed(seed)
    model_class = Qwen2ForCausalLM if spec.decoder == "qwen2" else LlamaForCausalLM
    model = model_class(_text_config(spec, vocab))
    model.save_pretrained(out)
    _write_spec(out, spec, seed, spec.decoder)
    return out


def build_llava(out_dir: str | Path, seed: int = 0, spec: TinyModelSpec | None = None) -> Path:
    """Write a random-weight llava-hf checkpoint to ``out_dir``; returns the path."""
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out, spec.vocab_size, style=spec.tokenizer_style)
    config = LlavaConfig(
        text_config=_text_config(spec, vocab),
        vision_config=_vision_config(spec),
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
    (out / "processor_config.json").write_text(json.dumps(_processor_config(spec), indent=2))
    _write_spec(out, spec, seed, "llava")
    return out


def build_llava_next(out_dir: str | Path, seed: int = 0, spec: TinyModelSpec | None = None) -> Path:
    """Write a random-weight llava-hf ``LlavaNextForConditionalGeneration`` checkpoint (any-resolution
    tiling over ``spec.grid_pinpoints``, CLIP tower) to ``out_dir``, with its image processor's and
    processor's config files; returns the path."""
    return _build_anyres(out_dir, seed, spec or TinyModelSpec(), onevision=False)


def build_llava_onevision(out_dir: str | Path, seed: int = 0, spec: TinyModelSpec | None = None) -> Path:
    """Write a random-weight llava-hf ``LlavaOnevisionForConditionalGeneration`` checkpoint (SigLIP
    tower, Qwen2 decoder, tiles over ``spec.grid_pinpoints`` pooled to ``spec.vision_aspect_ratio``)
    to ``out_dir``, with its image processor's and processor's config files; returns the path."""
    return _build_anyres(out_dir, seed, spec or ONEVISION_SPEC, onevision=True)


def _build_anyres(out_dir: str | Path, seed: int, spec: TinyModelSpec, onevision: bool) -> Path:
    import torch
    import transformers

    family = "LlavaOnevision" if onevision else "LlavaNext"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out, spec.vocab_size, style=spec.tokenizer_style)
    extra: dict[str, Any] = {"vision_aspect_ratio": spec.vision_aspect_ratio, "video_token_index": 3} if onevision else {}
    config = getattr(transformers, f"{family}Config")(
        text_config=_text_config(spec, vocab), vision_config=_vision_config(spec), image_token_index=4,
        vision_feature_layer=spec.vision_feature_layer,
        vision_feature_select_strategy=spec.vision_feature_select_strategy,
        image_grid_pinpoints=spec.grid_pinpoints, projector_hidden_act="gelu",
        tie_word_embeddings=spec.tie_word_embeddings, **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForConditionalGeneration")(config)
    model.save_pretrained(out)
    tile = {"height": spec.image_size, "width": spec.image_size}
    if onevision:  # a square resize of each tile, no crop
        preprocessor = {**_preprocessor_config(spec), "size": tile, "do_center_crop": False}
        processor = {"num_image_tokens": (spec.image_size // spec.patch_size) ** 2,
                     "vision_aspect_ratio": spec.vision_aspect_ratio}
    else:
        preprocessor = {**_preprocessor_config(spec), "size": {"shortest_edge": spec.image_size}, "crop_size": tile,
                        "do_center_crop": True}
        processor = {}
    preprocessor.update(image_processor_type=f"{family}ImageProcessor", image_grid_pinpoints=spec.grid_pinpoints,
                        do_pad=True)
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    (out / "processor_config.json").write_text(json.dumps({**_processor_config(spec), **processor,
                                                            "processor_class": f"{family}Processor"}, indent=2))
    _write_spec(out, spec, seed, "llava-onevision" if onevision else "llava-next")
    return out


def build_fast_vlm(out_dir: str | Path, seed: int = 0, spec: TinyModelSpec | None = None) -> Path:
    """Write a random-weight ``FastVlmForConditionalGeneration`` checkpoint (a timm FastViTHD tower
    built with ``pretrained=False``, Qwen2 decoder; each image ``(image_size // patch_size)**2``
    tokens, the tower's total stride being ``patch_size``) to ``out_dir``, with ``LlavaProcessor``'s
    config files; returns the path."""
    import torch
    from transformers import FastVlmConfig, FastVlmForConditionalGeneration

    spec = spec or FAST_VLM_SPEC
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out, spec.vocab_size, style=spec.tokenizer_style)
    config = FastVlmConfig(
        text_config=_text_config(spec, vocab), vision_config=_vision_config(spec), image_token_index=4,
        image_seq_length=(spec.image_size // spec.patch_size) ** 2, projector_hidden_act="gelu",
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    torch.manual_seed(seed)
    model = FastVlmForConditionalGeneration(config)
    _unit_variance(model.model.vision_tower, seed, spec.image_size)
    model.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(_preprocessor_config(spec), indent=2))
    (out / "processor_config.json").write_text(json.dumps(_processor_config(spec), indent=2))
    _write_spec(out, spec, seed, "fast-vlm")
    return out


def _unit_variance(tower: Any, seed: int, image_size: int) -> None:
    """Rescale a random timm tower so each convolution and linear layer puts out unit variance on
    random images, and its layer scales to 1: under the initializer's 0.02 std and timm's 1e-5 layer
    scales, FastViTHD's deep unnormalised stack puts out features of ~1e-10 that no image changes,
    and a test checkpoint whose images cannot change its tokens proves nothing. Data-dependent
    initialisation as in LSUV (Mishkin and Matas, "All you need is a good init", ICLR 2016), one
    layer at a time in module order, twice.
    """
    import torch

    probe = torch.rand(2, 3, image_size, image_size, generator=torch.Generator().manual_seed(seed))
    layers = [m for m in tower.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    with torch.no_grad():
        for name, param in tower.named_parameters():
            if name.endswith("layer_scale.gamma"):
                param.fill_(1.0)
        for _ in range(2):
            for layer in layers:
                seen: list[torch.Tensor] = []
                hook = layer.register_forward_hook(lambda _m, _i, out, into=seen: into.append(out))
                tower(probe)
                hook.remove()
                std = float(seen[0].std())
                if std > 0:
                    layer.weight.div_(std)
                    if layer.bias is not None:
                        layer.bias.div_(std)


# Qwen2-VL's shape: a ViT over 14 px patches merged 2x2 into tokens (so 28 px per token), a Qwen2 decoder
# with M-RoPE; images resized within 4 to 64 tokens' pixels
QWEN2_VL_SPEC = TinyModelSpec(decoder="qwen2", rope_theta=1_000_000.0, patch_size=14, image_size=28,
                              vision_hidden_size=64, vision_layers=2, vision_heads=2)
QWEN2_VL_PIXELS = QWEN2_VL_SPEC.pixel_bounds  # (min_pixels, max_pixels): 4 to 64 tokens per image

# The benchmark preset as Qwen2.5-VL: images of 64 to 768 tokens by their size
BENCH_QWEN_SPEC = replace(BENCH_SPEC, decoder="qwen2", rope_theta=1_000_000.0, patch_size=14, image_size=28,
                          pixel_bounds=(28 * 28 * 64, 28 * 28 * 768))


def build_qwen2_vl(out_dir: str | Path, seed: int = 0, spec: TinyModelSpec | None = None) -> Path:
    """Write a random-weight ``Qwen2VLForConditionalGeneration`` checkpoint (a ViT with 2-D rotary positions
    and a 2x2 patch merger, a Qwen2 decoder with M-RoPE sections of a quarter, three eighths and three
    eighths of its rotary pairs, as Qwen2-VL's 16/24/24 of 64) with ``Qwen2VLImageProcessor``'s and
    ``Qwen2VLVideoProcessor``'s configs (the spec's pixel bounds, for images and for each video frame) to
    ``out_dir``; returns the path.

    The image token is ``<image>`` (id 4) and the video token ``<video>`` (id 5) of the builder's tokenizer
    (a released checkpoint's are ``<|image_pad|>`` and ``<|video_pad|>`` between ``<|vision_start|>`` and
    ``<|vision_end|>``, all from its template).
    """
    return _build_qwen_vl(Path(out_dir), seed, spec or QWEN2_VL_SPEC, "Qwen2VL", "qwen2-vl")


def build_qwen2_5_vl(out_dir: str | Path, seed: int = 0, spec: TinyModelSpec | None = None) -> Path:
    """As :func:`build_qwen2_vl`, as ``Qwen2_5_VLForConditionalGeneration``: its ViT has RMSNorm and SwiGLU
    blocks and attends within windows of 2x2 merged tokens (56 px) but in its last block, which attends
    over the whole image."""
    return _build_qwen_vl(Path(out_dir), seed, spec or QWEN2_VL_SPEC, "Qwen2_5_VL", "qwen2.5-vl")


def _build_qwen_vl(out: Path, seed: int, spec: TinyModelSpec, family: str, kind: str) -> Path:
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out, spec.vocab_size, style=spec.tokenizer_style, video=True)
    text = _text_config(spec, vocab).to_dict()
    pairs = spec.hidden_size // spec.num_heads // 2
    temporal = pairs // 4
    section = [temporal, (pairs - temporal) // 2, pairs - temporal - (pairs - temporal) // 2]
    text.update(model_type="qwen2_vl_text" if family == "Qwen2VL" else "qwen2_5_vl_text", rope_parameters={
        "rope_type": "default", "rope_theta": spec.rope_theta, "mrope_section": section})
    vision: dict[str, Any] = {"depth": spec.vision_layers, "num_heads": spec.vision_heads, "patch_size": spec.patch_size,
                              "spatial_merge_size": 2, "temporal_patch_size": 2, "initializer_range": spec.initializer_range}
    if family == "Qwen2VL":
        vision.update(embed_dim=spec.vision_hidden_size, hidden_size=spec.hidden_size, mlp_ratio=2)
    else:
        vision.update(hidden_size=spec.vision_hidden_size, intermediate_size=spec.vision_intermediate_size,
                      out_hidden_size=spec.hidden_size, window_size=2 * 2 * spec.patch_size,
                      fullatt_block_indexes=[spec.vision_layers - 1])
    config = getattr(transformers, f"{family}Config")(
        text_config=text, vision_config=vision, image_token_id=4, video_token_id=5, vision_start_token_id=1,
        vision_end_token_id=2, tie_word_embeddings=spec.tie_word_embeddings)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForConditionalGeneration")(config)
    model.save_pretrained(out)
    transformers.Qwen2VLImageProcessorPil(
        min_pixels=spec.pixel_bounds[0], max_pixels=spec.pixel_bounds[1], patch_size=spec.patch_size, merge_size=2,
        temporal_patch_size=2, image_mean=spec.image_mean, image_std=spec.image_std).save_pretrained(str(out))
    transformers.Qwen2VLVideoProcessor(  # video frames within the image bounds, the reference's per-frame cap
        min_pixels=spec.pixel_bounds[0], max_pixels=spec.pixel_bounds[1], patch_size=spec.patch_size, merge_size=2,
        temporal_patch_size=2, image_mean=spec.image_mean, image_std=spec.image_std,
        cap_pixels_per_frame=True).save_pretrained(str(out))
    _write_spec(out, spec, seed, kind)
    return out


def _write_spec(out: Path, spec: TinyModelSpec, seed: int, kind: str) -> None:
    (out / "mm_serve_build.json").write_text(json.dumps({"kind": kind, "seed": seed, **asdict(spec)}, indent=2))


KINDS: dict[str, tuple[Any, TinyModelSpec]] = {
    "llava": (build_llava, TinyModelSpec()),
    "llava-siglip": (build_llava, TinyModelSpec(vision_tower="siglip")),
    "llava-qwen2": (build_llava, TinyModelSpec(decoder="qwen2", rope_theta=1_000_000.0)),
    "llava-next": (build_llava_next, TinyModelSpec()),
    "llava-onevision": (build_llava_onevision, ONEVISION_SPEC),
    "fast-vlm": (build_fast_vlm, FAST_VLM_SPEC),
    "llama": (build_llama, TinyModelSpec()),
    "qwen2": (build_llama, TinyModelSpec(decoder="qwen2", rope_theta=1_000_000.0, tie_word_embeddings=True)),
    "qwen2-vl": (build_qwen2_vl, QWEN2_VL_SPEC),
    "qwen2.5-vl": (build_qwen2_5_vl, QWEN2_VL_SPEC),
    "bench": (build_llava, BENCH_SPEC),
    "bench-next": (build_llava_next, BENCH_NEXT_SPEC),
    "bench-llama": (build_llama, BENCH_SPEC),
    "bench-qwen2.5-vl": (build_qwen2_5_vl, BENCH_QWEN_SPEC),
}


def main(argv: list[str] | None = None) -> int:
    """CLI: build a checkpoint; prints its path."""
    parser = argparse.ArgumentParser(prog="python -m mm_serve.models.builder", description=__doc__)
    parser.add_argument("kind", choices=list(KINDS))
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    build, spec = KINDS[args.kind]
    path = build(args.out, args.seed, spec)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
