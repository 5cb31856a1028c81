"""Per-GPU memory: weights of the largest stage and the KV-cache capacity left over.

An instance with tensor degree ``t`` and pipeline degree ``p`` holds on each GPU
``1/t`` of its stage's weights (``ceil(L/p)`` layers, plus the embeddings and the
vision tower, conservatively counted on every stage) and ``1/t`` of the KV heads of
those layers (a KV head is replicated when ``t`` exceeds the KV-head count).
Usable memory is ``memory_utilization * memory_bytes - activation_reserve_bytes``,
as vLLM's ``gpu_memory_utilization`` (Kwon et al., SOSP 2023, §4.3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mm_serve.planner.hardware import Hardware
from mm_serve.planner.latency_model import ParallelConfig
from mm_serve.planner.model_shape import ModelShape


@dataclass(frozen=True)
class MemoryPlan:
    """Memory of one instance: bytes per GPU and the KV capacity in tokens."""

    weight_bytes_per_gpu: float
    kv_bytes_per_token_per_gpu: float
    kv_capacity_tokens: int  # 0 when the weights do not fit

    @property
    def fits(self) -> bool:
        return self.kv_capacity_tokens > 0


def usable_bytes(hw: Hardware) -> float:
    """Bytes per GPU for weights and KV: ``memory_utilization`` of the memory, less the
    activation reserve (vLLM's ``gpu_memory_utilization``)."""
    return hw.memory_utilization * hw.memory_bytes - hw.activation_reserve_bytes


def memory_plan(shape: ModelShape, hw: Hardware, par: ParallelConfig, vision: bool) -> MemoryPlan:
    """Weights and KV capacity of an instance with ``par``; ``vision`` if it runs the
    vision tower (prefill and colocated instances of a multimodal model)."""
    layers = math.ceil(shape.num_layers / par.pp)
    params = layers * shape.layer_params + shape.embedding_params
    if vision and shape.vision is not None:
        params += shape.vision.params
    weights = params * shape.dtype_bytes / par.tp
    kv_heads = max(1.0, shape.num_kv_heads / par.tp)
    kv_per_token = 2 * layers * kv_heads * shape.head_dim * shape.dtype_bytes
    free = usable_bytes(hw) - weights
    capacity = int(free // kv_per_token) if free > 0 else 0
    return MemoryPlan(weights, kv_per_token, capacity)
