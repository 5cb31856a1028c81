"""Small factories for tests: checkpoints, images in every Pillow mode, requests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import zmq
from PIL import Image

from mm_serve.media.video_loading import Video
from mm_serve.models.builder import (
    FAST_VLM_SPEC,
    KINDS,
    ONEVISION_SPEC,
    QWEN2_VL_SPEC,
    TinyModelSpec,
    build_llava,
)
from mm_serve.runtime.worker_channel import WorkerChannel

SPECS: dict[str, TinyModelSpec] = {
    "llava": TinyModelSpec(),
    "llava-multilayer": TinyModelSpec(
        vision_feature_layer=[-3, -1], vision_feature_select_strategy="full", center_crop=False,
        tie_word_embeddings=True, num_layers=3, num_heads=4, num_kv_heads=4, vision_layers=3,
    ),
    # llava-1.5-hf's arrangement: a Llama-style tokenizer that adds BOS, a template without it
    "llava-sp": TinyModelSpec(tokenizer_style="llama"),
    "llama": TinyModelSpec(num_layers=3, num_heads=4, num_kv_heads=1, hidden_size=96, intermediate_size=160),
    # a SigLIP tower (no class token, square resize) with the strategy that drops the first position
    "llava-siglip": TinyModelSpec(vision_tower="siglip"),
    # a Qwen2 decoder (q/k/v biases, rope theta 1e6) under a CLIP tower, and one text-only with tied embeddings
    "llava-qwen2": TinyModelSpec(decoder="qwen2", rope_theta=1_000_000.0),
    "qwen2": TinyModelSpec(decoder="qwen2", rope_theta=1_000_000.0, tie_word_embeddings=True, num_layers=3),
    # LLaVA-NeXT: 56 px tiles on grids up to 2x2 and 1x3 (builder's grid_pinpoints), CLIP, Llama
    "llava-next": TinyModelSpec(),
    # LLaVA-OneVision: SigLIP (all positions), Qwen2, grids up to 4x4 pooled above anyres_max_4
    "llava-onevision": ONEVISION_SPEC,
    # FastVLM: a timm FastViTHD tower (stride 64, 256 px -> 16 tokens), Qwen2
    "fast-vlm": FAST_VLM_SPEC,
    # Qwen2-VL: 14 px patches merged 2x2, 4 to 64 tokens per image, Qwen2 with M-RoPE
    "qwen2-vl": QWEN2_VL_SPEC,
    "qwen2.5-vl": QWEN2_VL_SPEC,  # the same with Qwen2.5-VL's windowed ViT
}


def build_checkpoint(kind: str, out: Path, seed: int = 0) -> Path:
    """Build the named test checkpoint into ``out``: the builder's function for the kind
    (:data:`mm_serve.models.builder.KINDS`; a llava for the test-only kinds) with the test spec."""
    build = KINDS[kind][0] if kind in KINDS else build_llava
    path = build(out, seed, SPECS[kind])
    if kind == "llama":
        _set_llama3_rope(path)
    return Path(path)


def _set_llama3_rope(path: Path) -> None:
    """Give the text-only test model llama3 RoPE scaling, so that code path is covered."""
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_parameters"] = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
    }
    cfg_path.write_text(json.dumps(cfg, indent=2))


def gradient_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A deterministic RGB image with structure (gradients plus noise)."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 255, width)[None, :, None]
    y = np.linspace(0, 255, height)[:, None, None]
    base = np.concatenate([x + 0 * y, y + 0 * x, (x + y) / 2], axis=2)
    noisy = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(noisy)


def gradient_video(frames: int, width: int, height: int, seed: int = 0, fps: float = 2.0) -> Video:
    """A deterministic video of ``frames`` :func:`gradient_image` frames (each its own noise), sampled at
    ``fps``."""
    return Video(np.stack([np.asarray(gradient_image(width, height, seed * 1000 + i)) for i in range(frames)]), fps)


def image_in_mode(mode: str, width: int = 64, height: int = 48, seed: int = 0) -> Image.Image:
    """``gradient_image`` converted to a Pillow ``mode`` (1, L, LA, P, RGBA, CMYK, I;16, I, F)."""
    rgb = gradient_image(width, height, seed)
    if mode in ("I;16", "I", "F"):
        gray = np.asarray(rgb.convert("L"), dtype=np.float64)
        if mode == "I;16":
            return Image.fromarray((gray * 257).astype(np.uint16))
        if mode == "I":
            return Image.fromarray((gray * 1000).astype(np.int32))
        return Image.fromarray((gray / 255).astype(np.float32))
    if mode in ("LA", "RGBA"):
        img = rgb.convert(mode)
        alpha = Image.fromarray(np.tile(np.linspace(0, 255, width, dtype=np.uint8), (height, 1)))
        img.putalpha(alpha)
        return img
    return rgb.convert(mode)


@contextmanager
def front_end_channel(tmp_path: Path, kind: object) -> Iterator[tuple[WorkerChannel, zmq.Socket, zmq.Socket]]:  # type: ignore[type-arg]
    """A worker's :class:`WorkerChannel` wired to front-end sockets bound in ``tmp_path``:
    yields (channel, control PUSH, output PULL); all closed after."""
    ctx = zmq.Context.instance()
    control, output = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    control.bind(f"ipc://{tmp_path}/ctl")
    output.bind(f"ipc://{tmp_path}/out")
    channel = WorkerChannel(f"ipc://{tmp_path}/ctl", f"ipc://{tmp_path}/out", kind)
    try:
        yield channel, control, output
    finally:
        channel.close()
        control.close(0)
        output.close(0)
