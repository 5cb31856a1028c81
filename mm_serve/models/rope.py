"""Rotary position embeddings (RoPE; Su et al. 2021, arXiv:2104.09864) in the Llama layout.

The rotation pairs dimension ``i`` with ``i + head_dim/2`` ("rotate half"), as in
the Hugging Face Llama implementation, so checkpoints trained with it match.
Scaling variants: ``linear`` (position interpolation, Chen et al. 2023,
arXiv:2306.15595) and ``llama3`` (Llama 3.1 report, frequency-banded scaling).
"""

from __future__ import annotations

import math

import torch

from mm_serve.models.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies ``[head_dim // 2]`` (float32, on the CPU), scaling applied.

    Computed on the CPU even inside a ``torch.device("meta")`` block (the loader's): meta arithmetic
    runs torch's reference kernels, whose first use imports torch._dynamo (a second of a worker's start)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(torch.nn.Module):
    """Computes ``cos``/``sin`` tables for positions and applies the rotation.

    Shapes: positions ``[T]`` int64 → cos, sin ``[T, head_dim]`` in the model dtype.
    """

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        self.register_buffer("inv_freq", inverse_frequencies(rope, head_dim), persistent=False)

    def reset_inv_freq(self, device: torch.device) -> None:
        """Recompute the (non-persistent) frequency buffer, e.g. after ``to_empty``."""
        self.inv_freq = inverse_frequencies(self.rope, self.head_dim).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[T, head_dim]``, for integer ``positions`` ``[T]``, or with M-RoPE
        (``rope.mrope_section``) ``[3, T]``: temporal, height and width ids, rotary pair ``i`` turned by
        the row of the section it falls in (transformers' ``apply_multimodal_rotary_pos_emb``). A text
        token's three ids are equal, so ``[T]`` serves text and decode steps under M-RoPE too.

        Raises:
            ValueError: ``[3, T]`` positions without M-RoPE sections.
        """
        if positions.dim() == 1:
            freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :].float()
        else:
            rows = self._section_rows(positions.device)
            picked = positions.to(torch.float32)[rows]  # [head_dim / 2, T]: each pair's own position row
            freqs = picked.t() * self.inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _section_rows(self, device: torch.device) -> torch.Tensor:
        """Position row (0 temporal, 1 height, 2 width) of each rotary pair ``[head_dim / 2]``."""
        sections = self.rope.mrope_section
        if not sections:
            raise ValueError("3-row positions need M-RoPE (rope mrope_section)")
        rows = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(sections)])
        if rows.numel() != self.head_dim // 2:
            raise ValueError(f"mrope_section {sections} covers {rows.numel()} rotary pairs, not {self.head_dim // 2}")
        return rows.to(device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by ``cos``/``sin`` ``[T, head_dim]``."""
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
