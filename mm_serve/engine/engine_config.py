"""Resolved settings of one engine instance (derived once from the service config or arguments)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mm_serve.models.model_config import TextConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """Engine sizing. ``max_model_len`` 0 means the checkpoint's ``max_position_embeddings``."""

    page_size: int = 16  # tokens per KV page
    num_pages: int = 2048  # KV pages of this engine
    max_running: int = 64  # decode_max_concurrent
    prefill_token_budget: int = 4096  # tokens per prefill batch
    prefill_batch_size: int = 8  # requests per prefill batch
    max_model_len: int = 0  # prompt + output tokens at most
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0  # seeds generators of requests that bring no seed
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps on a GPU
    cpu_gemm: str = "onednn"  # float32 on a CPU: "onednn" (packed weights, kernels/cpu_linear.py) or "torch" (F.linear)
    cpu_kernels: str = "compiled"  # float32 CPU: "compiled" (decode attention + RMSNorm from kernels/csrc) or "torch"

    @property
    def use_cuda_graphs(self) -> bool:
        """Decode steps are captured in CUDA graphs: a CUDA device and not ``enforce_eager``."""
        return self.device.startswith("cuda") and not self.enforce_eager

    @property
    def pack_cpu_linears(self) -> bool:
        """Linear layers run from oneDNN-packed weights (``cpu_gemm`` onednn; float32 CPU layers only)."""
        return self.cpu_gemm == "onednn"

    @property
    def compiled_cpu_kernels(self) -> bool:
        """Decode attention and RMSNorm run the compiled kernels: ``cpu_kernels`` compiled, float32, a CPU."""
        return self.cpu_kernels == "compiled" and self.device.startswith("cpu") and self.dtype == "float32"

    def __post_init__(self) -> None:
        positive = ("page_size", "num_pages", "max_running", "prefill_token_budget", "prefill_batch_size")
        for name in (*positive, "max_model_len", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if name in positive and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        if not isinstance(self.device, str):
            raise ValueError(f"device must be a string such as 'cpu' or 'cuda:0', got {self.device!r}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0 (0: the checkpoint's), got {self.max_model_len}")
        if not isinstance(self.cpu_gemm, str) or self.cpu_gemm not in ("onednn", "torch"):
            raise ValueError(f"cpu_gemm must be 'onednn' or 'torch', got {self.cpu_gemm!r}")
        if not isinstance(self.cpu_kernels, str) or self.cpu_kernels not in ("compiled", "torch"):
            raise ValueError(f"cpu_kernels must be 'compiled' or 'torch', got {self.cpu_kernels!r}")
        if not isinstance(self.dtype, str) or self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    def resolved_max_model_len(self, text: TextConfig) -> int:
        """``max_model_len``, or the checkpoint's ``max_position_embeddings`` when it is 0."""
        return self.max_model_len or text.max_position_embeddings

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]
