"""Worker start-up steps shared by every role: pin cores, set threads, load the model, size the KV cache."""

from __future__ import annotations

import os

import torch

from mm_serve.models.llava import MultimodalLM
from mm_serve.models.loader import load_model
from mm_serve.models.model_config import ModelConfig, load_model_config
from mm_serve.runtime.engine_config import EngineConfig
from mm_serve.runtime.kv_cache import PagedKVCache
from mm_serve.runtime.worker_spec import WorkerSpec


def pin_and_set_threads(spec: WorkerSpec) -> None:
    """Pin this process to ``spec.cpus`` (if any) and set torch's intra-op thread count."""
    if spec.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(spec.cpus))
    threads = spec.threads or len(spec.cpus)
    if threads:
        torch.set_num_threads(threads)


def load_model_for(model_dir: str, cfg: EngineConfig) -> MultimodalLM:
    """The checkpoint at ``model_dir`` in ``cfg``'s dtype, device and CPU kernel choices.

    Raises:
        CheckpointError: the checkpoint is missing or unreadable.
    """
    return load_model(
        model_dir, cfg.torch_dtype, cfg.device, pack_cpu_linears=cfg.pack_cpu_linears,
        compiled_cpu_kernels=cfg.compiled_cpu_kernels,
    )


def make_kv_cache(model_config: ModelConfig, cfg: EngineConfig) -> PagedKVCache:
    """``cfg.num_pages`` KV pages shaped for ``model_config``'s decoder."""
    text = model_config.text
    return PagedKVCache(
        text.num_layers, cfg.num_pages, cfg.page_size, text.num_kv_heads, text.head_dim,
        cfg.torch_dtype, cfg.device,
    )


def load_for_worker(spec: WorkerSpec) -> tuple[ModelConfig, MultimodalLM, PagedKVCache]:
    """Load the checkpoint and allocate this worker's paged KV cache."""
    model_config = load_model_config(spec.model_dir)
    return model_config, load_model_for(spec.model_dir, spec.sizing), make_kv_cache(model_config, spec.sizing)
