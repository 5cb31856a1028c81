"""Our Llama-family decoder over a paged KV cache (Touvron et al. 2023, arXiv:2302.13971).

RMSNorm, RoPE, grouped-query attention, SiLU-gated MLP, tied or untied
embeddings. Tokens of a batch are flattened to ``[T, hidden]``; the attention
backend (``kernels/``) handles per-sequence boundaries and the paged cache.
Weight names match the Hugging Face Llama checkpoints (``layers.N.self_attn.o_proj.weight``, ...)
except for two fused projections, stacked on load (:mod:`mm_serve.models.fused_weights`):
``self_attn.qkv_proj`` (rows ``[q | k | v]``) and ``mlp.gate_up_proj`` (rows ``[gate | up]``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mm_serve.kernels.attention_backend import AttentionBackend
from mm_serve.kernels.attention_metadata import AttentionMetadata
from mm_serve.models.model_config import TextConfig
from mm_serve.models.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), computed in float32."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        # The compiled one-pass kernel (kernels/csrc/rms_norm_cpu.cpp) for float32 CPU
        # inference, set by the loader (``compiled_cpu_kernels``); None: torch's ops.
        self.compiled_kernel: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            if self.compiled_kernel is not None and x.device.type == "cpu" and not torch.is_grad_enabled():
                return self.compiled_kernel(x.contiguous(), self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op, same formula
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class LlamaAttention(nn.Module):
    """Multi-head attention with GQA and RoPE; K/V go to the paged cache."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        bias = cfg.attention_bias  # on every projection (Llama's attention_bias)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias or cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
        k_cache: torch.Tensor, v_cache: torch.Tensor, backend: AttentionBackend,
    ) -> torch.Tensor:
        """``[T, hidden]`` for ``x`` ``[T, hidden]``; in a mixed pass (``meta.decode`` set) the
        projections run over all rows, each part's attention over its own rows."""
        qkv = self.qkv_proj(x)
        if meta.decode is None:
            out = self._attend(qkv, cos, sin, meta, k_cache, v_cache, backend)
        else:
            rows = meta.num_tokens  # the prefill rows come first
            out = torch.cat([
                self._attend(qkv[:rows], cos[:rows], sin[:rows], meta, k_cache, v_cache, backend),
                self._attend(qkv[rows:], cos[rows:], sin[rows:], meta.decode, k_cache, v_cache, backend),
            ])
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))

    def _attend(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
        k_cache: torch.Tensor, v_cache: torch.Tensor, backend: AttentionBackend,
    ) -> torch.Tensor:
        """Attention ``[n, num_heads, head_dim]`` of the rows ``qkv`` ``[n, q_size + 2 kv_size]`` that ``meta`` describes."""
        tokens = qkv.shape[0]
        fused = backend.fused_decode(qkv, cos, sin, self.num_heads, k_cache, v_cache, meta, self.scale)
        if fused is not None:  # RoPE, K/V write and attention in one kernel
            return fused
        qk_size = self.q_size + self.kv_size
        # RoPE on the query and key heads together (they are adjacent in the fused output)
        qk = apply_rotary(qkv[:, :qk_size].view(tokens, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, qk_size:].view(tokens, self.num_kv_heads, self.head_dim)
        return backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)


class LlamaMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` (Shazeer 2020, GLU variants)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        bias = cfg.mlp_bias
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, meta, k_cache, v_cache, backend):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head.

    ``forward(inputs_embeds [T, hidden], positions [T], meta, kv_caches)`` returns
    the final hidden states ``[T, hidden]``; ``compute_logits`` maps selected rows
    to ``[N, vocab_size]`` logits in float32. ``kv_caches[i]`` is the
    ``(k_cache, v_cache)`` pair of layer ``i``, each ``[P, S, Hkv, D]``.
    """

    def __init__(self, cfg: TextConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.backend = backend
        # every weight comes from the checkpoint: an uninitialised table skips the random init, which on the
        # meta device (the loader's) runs torch's reference kernels and imports torch._dynamo (1 s of a worker's start)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden]`` for ids ``[T]``."""
        return self.embed_tokens(input_ids)

    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        cos, sin = self.rotary.cos_sin(positions, inputs_embeds.dtype)
        x = inputs_embeds
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, meta, k_cache, v_cache, self.backend)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab_size]`` (float32) for hidden states ``[N, hidden]``."""
        return self.lm_head(hidden).float()
