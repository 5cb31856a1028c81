"""Worker start-up steps shared by every role: pin cores, set threads, load the model, size the KV cache."""

from __future__ import annotations

import os

import torch

from mm_serve.engine.engine_config import EngineConfig
from mm_serve.engine.worker_spec import EngineSizing, WorkerSpec
from mm_serve.models.llava import MultimodalLM
from mm_serve.models.loader import load_model
from mm_serve.models.model_config import ModelConfig, load_model_config
from text_decode.kv_cache import PagedKVCache


def pin_and_set_threads(spec: WorkerSpec) -> None:
    """Pin this process to ``spec.cpus`` (if any) and set torch's intra-op thread count."""
    if spec.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(spec.cpus))
    threads = spec.threads or len(spec.cpus)
    if threads:
        torch.set_num_threads(threads)


def engine_config_from_sizing(s: EngineSizing) -> EngineConfig:
    """:class:`EngineConfig` of the wire-format sizing ``s`` (same fields)."""
    return EngineConfig(
        page_size=s.page_size, num_pages=s.num_pages, max_running=s.max_running,
        prefill_token_budget=s.prefill_token_budget, prefill_batch_size=s.prefill_batch_size,
        max_model_len=s.max_model_len, dtype=s.dtype, device=s.device, seed=s.seed, enforce_eager=s.enforce_eager,
        cpu_gemm=s.cpu_gemm, cpu_kernels=s.cpu_kernels,
    )


def load_for_worker(spec: WorkerSpec) -> tuple[ModelConfig, MultimodalLM, PagedKVCache, EngineConfig]:
    """Load the checkpoint and allocate this worker's paged KV cache."""
    cfg = engine_config_from_sizing(spec.sizing)
    model_config = load_model_config(spec.model_dir)
    model = load_model(
        spec.model_dir, cfg.torch_dtype, cfg.device, pack_cpu_linears=cfg.pack_cpu_linears,
        compiled_cpu_kernels=cfg.compiled_cpu_kernels,
    )
    text = model_config.text
    kv_cache = PagedKVCache(
        text.num_layers, cfg.num_pages, cfg.page_size, text.num_kv_heads, text.head_dim,
        cfg.torch_dtype, cfg.device,
    )
    return model_config, model, kv_cache, cfg
