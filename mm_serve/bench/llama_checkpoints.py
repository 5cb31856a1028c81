"""The random Llama checkpoints the decode benchmarks run on, built once into the temp folder."""

from __future__ import annotations

import tempfile
from pathlib import Path

from mm_serve.models.builder import BENCH_SPEC, TinyModelSpec, build_llama

LARGE_SPEC = TinyModelSpec(
    vocab_size=2048, hidden_size=2048, intermediate_size=5632, num_layers=16, num_heads=16, num_kv_heads=8,
    initializer_range=0.02,
)  # ~0.9 B parameters: meant for a GPU


def llama_checkpoint(name: str) -> Path:
    """``name`` as a checkpoint folder: an existing folder as it is, else ``bench`` (8 layers, hidden 512),
    ``large`` (:data:`LARGE_SPEC`) or any other name the tiny spec, built on first use (seed 0)."""
    if Path(name).is_dir():
        return Path(name)
    spec = {"bench": BENCH_SPEC, "large": LARGE_SPEC}.get(name, TinyModelSpec())
    out = Path(tempfile.gettempdir()) / f"mm_serve_bench_{name}_llama"
    if not (out / "config.json").is_file():
        build_llama(out, seed=0, spec=spec)
    return out
