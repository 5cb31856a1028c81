"""Sizing of one engine instance: the one type, with the one set of defaults.

The service config (:mod:`mm_serve.config`) takes its defaults from here, the front
end resolves it once per worker (``mm_serve.cluster.worker_specs.engine_sizing``), and
it crosses to the worker inside its :class:`~mm_serve.runtime.worker_spec.WorkerSpec`
as it is (a frozen msgspec struct, validated again when decoded there).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from mm_serve.ground.dtypes import DTYPE_CHOICES, DTypeChoice, resolve_dtype, torch_dtype

if TYPE_CHECKING:  # torch is imported only where a dtype is needed (the config loads without it)
    import torch

    from mm_serve.models.model_config import TextConfig

_POSITIVE = ("page_size", "num_pages", "max_running", "prefill_token_budget", "prefill_batch_size")


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Engine sizing. ``max_model_len`` 0 means the checkpoint's ``max_position_embeddings``.

    Raises:
        ValueError: a field of the wrong type or out of range (the message names it and the value).
    """

    page_size: int = 16  # tokens per KV page (kv_cache.page_size)
    num_pages: int = 2048  # KV pages of this engine (kv_cache.max_pages_per_gpu)
    max_running: int = 64  # running requests at most (scheduler.decode_max_concurrent)
    prefill_token_budget: int = 4096  # tokens per prefill batch (scheduler.prefill_token_budget)
    prefill_batch_size: int = 8  # requests per prefill batch (scheduler.prefill_batch_size)
    prefill_chunk_tokens: int = 2048  # prefill worker: longer prompts are prefilled in chunks of this many tokens; 0 = never
    mixed_step_tokens: int = 2048  # colocated: tokens per step (a decode token per running request + prefill chunks); 0 = prefill and decode steps apart
    decode_step_interval_s: float = 0.0  # decode worker: a decode step starts at least this long after the previous one began; 0 = at once
    decode_step_pacing: float = 0.0  # decode worker: ... at least this fraction of the tightest TPOT SLO among its running requests; 0 = off
    decode_pacing_always: bool = False  # decode worker: pace even while nothing else runs on its cores (mm_serve.runtime.core_load.CoreDemand)
    tier_tpot_s: tuple[float, ...] = (0.1, 0.25, 2.0)  # TPOT SLO of each tier by rank (interactive, standard, batch), seconds
    max_model_len: int = 0  # prompt + output tokens at most; 0 = the checkpoint's
    dtype: DTypeChoice = "auto"  # "auto": the checkpoint's on a GPU, float32 on a CPU (for_checkpoint, before a model loads)
    device: str = "cpu"
    seed: int = 0  # seeds generators of requests that bring no seed
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps on a GPU
    cpu_gemm: Literal["onednn", "torch"] = "onednn"  # float32 on a CPU: "onednn" (packed weights, mm_serve/kernels/cpu_linear.py) or "torch" (F.linear)
    cpu_kernels: Literal["compiled", "torch"] = "compiled"  # float32 CPU: "compiled" (decode attention + RMSNorm from kernels/csrc) or "torch"
    attention_backend: Literal["auto", "flex", "torch"] = "auto"  # mm_serve.kernels.backend_select
    enable_prefix_caching: bool = True  # reuse the KV of cached full pages (kv_cache.enable_prefix_caching)
    encoder_cache_bytes: int = 256 * 1024 * 1024  # image embeddings kept by content hash; 0 = off (cache.encoder_cache_bytes)

    def __post_init__(self) -> None:
        for name in (*_POSITIVE, "max_model_len", "seed", "prefill_chunk_tokens", "mixed_step_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if name in _POSITIVE and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in ("enforce_eager", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.encoder_cache_bytes, int) or isinstance(self.encoder_cache_bytes, bool) \
                or self.encoder_cache_bytes < 0:
            raise ValueError(f"encoder_cache_bytes must be an integer >= 0, got {self.encoder_cache_bytes!r}")
        if not isinstance(self.device, str):
            raise ValueError(f"device must be a string such as 'cpu' or 'cuda:0', got {self.device!r}")
        if self.prefill_chunk_tokens < 0:
            raise ValueError(f"prefill_chunk_tokens must be >= 0 (0: never split), got {self.prefill_chunk_tokens}")
        if not 0 <= self.mixed_step_tokens <= 1 << 20:
            raise ValueError(f"mixed_step_tokens must be in [0, {1 << 20}] (0: no mixed steps), got {self.mixed_step_tokens}")
        interval = self.decode_step_interval_s
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0.0 <= interval <= 1.0:
            raise ValueError(f"decode_step_interval_s must be a number of seconds in [0, 1], got {interval!r}")
        pacing = self.decode_step_pacing
        if isinstance(pacing, bool) or not isinstance(pacing, (int, float)) or not 0.0 <= pacing < 1.0:
            raise ValueError(f"decode_step_pacing must be a fraction in [0, 1), got {pacing!r}")
        if pacing and interval:
            raise ValueError("decode_step_pacing and decode_step_interval_s are two ways to pace decode steps: set one")
        if not self.tier_tpot_s or any(isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0
                                       for t in self.tier_tpot_s):
            raise ValueError(f"tier_tpot_s must list positive seconds, one per tier, got {self.tier_tpot_s!r}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0 (0: the checkpoint's), got {self.max_model_len}")
        if not isinstance(self.cpu_gemm, str) or self.cpu_gemm not in ("onednn", "torch"):
            raise ValueError(f"cpu_gemm must be 'onednn' or 'torch', got {self.cpu_gemm!r}")
        if not isinstance(self.cpu_kernels, str) or self.cpu_kernels not in ("compiled", "torch"):
            raise ValueError(f"cpu_kernels must be 'compiled' or 'torch', got {self.cpu_kernels!r}")
        if not isinstance(self.attention_backend, str) or self.attention_backend not in ("auto", "flex", "torch"):
            raise ValueError(f"attention_backend must be 'auto', 'flex' or 'torch', got {self.attention_backend!r}")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {list(DTYPE_CHOICES)}, got {self.dtype!r}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return cls.__struct_fields__

    def replace(self, **changes: object) -> EngineConfig:
        """A copy with ``changes`` applied (validated again).

        Raises:
            ValueError: a bad value, or a name that is not a field.
        """
        unknown = sorted(set(changes) - set(self.__struct_fields__))
        if unknown:
            raise ValueError(f"unknown engine settings {unknown}; allowed: {list(self.__struct_fields__)}")
        return msgspec.structs.replace(self, **changes)

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

    def for_checkpoint(self, raw: Mapping[str, Any]) -> EngineConfig:
        """This sizing with ``dtype: auto`` replaced by the element type the checkpoint's
        ``config.json`` (``raw``) declares on a CUDA device, float32 on a CPU
        (:func:`~mm_serve.ground.dtypes.resolve_dtype`)."""
        if self.dtype != "auto":
            return self
        return self.replace(dtype=resolve_dtype(self.dtype, raw, on_gpu=self.device.startswith("cuda")))

    @property
    def torch_dtype(self) -> torch.dtype:
        """The ``torch.dtype`` of :attr:`dtype`.

        Raises:
            ValueError: :attr:`dtype` is still ``auto`` (:meth:`for_checkpoint` was not applied).
        """
        if self.dtype == "auto":
            raise ValueError("dtype 'auto' is resolved against a checkpoint first (EngineConfig.for_checkpoint)")
        return torch_dtype(self.dtype)

    def context_limit(self, text: TextConfig) -> int:
        """Prompt plus output tokens one request may reach, in tokens: the context length
        (``max_model_len``, else the checkpoint's ``max_position_embeddings``), capped by
        what the whole KV cache holds (``num_pages * page_size``)."""
        return min(self.max_model_len or text.max_position_embeddings, self.num_pages * self.page_size)


DEFAULT_ENGINE = EngineConfig()
"""The defaults, for the service config's fields to take theirs from."""
