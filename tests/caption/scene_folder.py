"""A folder of drawn held-out scenes with their true captions, plus the three broken files."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from mm_serve.shapes.evaluate import heldout_scenes
from mm_serve.shapes.targets import caption

NUM_SCENES = 60
BROKEN = ("broken/truncated.png", "broken/not_an_image.jpg", "broken/bomb.png")
# Lossless formats only, so every scene reaches the model pixel-exact (as in the model's eval).
_FORMATS: tuple[tuple[str, str, dict[str, bool]], ...] = (("png", "PNG", {}), ("bmp", "BMP", {}), ("tiff", "TIFF", {}), ("webp", "WEBP", {"lossless": True}))


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A tiny PNG whose header declares ``width x height`` px (a decompression bomb)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header)
            + _png_chunk(b"IDAT", zlib.compress(b"\0" * 64)) + _png_chunk(b"IEND", b""))


def write_scene_folder(root: Path, n: int) -> dict[str, str]:
    """The first ``n`` held-out scenes (seed 0) under ``root`` plus the 3 broken files; id → true caption.

    Scenes alternate png / bmp / tiff / lossless webp and sit in two sub-folders.
    """
    truth: dict[str, str] = {}
    for index, scene in enumerate(heldout_scenes(n, seed=0)):
        suffix, fmt, options = _FORMATS[index % len(_FORMATS)]
        rel = f"{'even' if index % 2 == 0 else 'odd'}/scene{index:03d}.{suffix}"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        scene.image.save(root / rel, format=fmt, **options)
        truth[rel] = caption(scene.objects)
    (root / "broken").mkdir(parents=True, exist_ok=True)
    good = (root / "even/scene000.png").read_bytes()
    (root / BROKEN[0]).write_bytes(good[: len(good) // 2])
    (root / BROKEN[1]).write_text("this is a text file, not a JPEG\n")
    (root / BROKEN[2]).write_bytes(bomb_png())
    return truth
