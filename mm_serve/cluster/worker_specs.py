"""Build every worker's :class:`WorkerSpec` from the service config."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from mm_serve.cluster.launcher import available_cpus, default_role_cpus, split_cpus
from mm_serve.config import ComputeConfig, ConfigError, ServiceConfig
from mm_serve.ground.roles import Role
from mm_serve.ground.tiers import Tier
from mm_serve.models.model_config import ModelConfig
from mm_serve.runtime.engine_config import EngineConfig
from mm_serve.runtime.worker_spec import WorkerSpec
from mm_serve.transport.doorbell import doorbell_address
from mm_serve.transport.ring_spec import RingSpec


def engine_sizing(cfg: ServiceConfig, device: str = "cpu") -> EngineConfig:
    """The engine sizing a worker on ``device`` gets from the service config (the one place
    where service keys map onto engine fields)."""
    return EngineConfig(
        page_size=cfg.kv_cache.page_size, num_pages=cfg.kv_cache.max_pages_per_gpu,
        max_running=cfg.scheduler.decode_max_concurrent, prefill_token_budget=cfg.scheduler.prefill_token_budget,
        prefill_batch_size=cfg.scheduler.prefill_batch_size, prefill_chunk_tokens=cfg.scheduler.prefill_chunk_tokens,
        mixed_step_tokens=cfg.scheduler.mixed_step_tokens,
        decode_step_interval_s=cfg.scheduler.decode_step_interval_ms / 1000.0,
        decode_step_pacing=cfg.scheduler.decode_step_pacing,
        decode_pacing_always=cfg.scheduler.decode_pacing_always,
        tier_tpot_s=tuple(cfg.slo.of(tier).tpot_s for tier in Tier),
        dtype=cfg.dtype, device=device, seed=cfg.seed,
        enforce_eager=cfg.enforce_eager, cpu_gemm=cfg.cpu_gemm,
        cpu_kernels=cfg.cpu_kernels, attention_backend=cfg.attention_backend, enable_prefix_caching=cfg.kv_cache.enable_prefix_caching,
        encoder_cache_bytes=cfg.cache.encoder_cache_bytes,
    )


def check_supported(cfg: ServiceConfig) -> None:
    """Refuse configs the runtime cannot run (the planner may still model them).

    Raises:
        ConfigError: TP or PP above 1, or (local backend) GPUs configured where CUDA is unavailable or
            cores this process may not run on (:func:`check_cores`).
    """
    compute = cfg.compute
    for role in (Role.PREFILL, Role.DECODE):
        if getattr(compute, f"{role}_tensor_parallel") > 1 or getattr(compute, f"{role}_pipeline_parallel") > 1:
            raise ConfigError(
                f"compute.{role}_tensor_parallel / {role}_pipeline_parallel > 1 is not supported by the runtime "
                "yet (the planner models it); run more instances with TP = PP = 1 instead"
            )
    if compute.uses_gpus and cfg.cluster.backend == "local":
        import torch  # with Ray, each worker's node has the GPU Ray gives it

        if not torch.cuda.is_available():
            raise ConfigError("compute.prefill_gpus / decode_gpus are set but CUDA is not available here")
    check_cores(cfg)


def check_cores(cfg: ServiceConfig, usable: Iterable[int] | None = None) -> None:
    """Refuse core ids in ``compute.prefill_cpus`` / ``decode_cpus`` that this process may not run on
    (``usable``, by default :func:`~mm_serve.cluster.launcher.available_cpus`: ``os.sched_getaffinity(0)``
    where there is one): a worker pinned to none of its cores would run unpinned, on any of them. Checked
    where the config meets this machine (at start), not when a config is read: a config may be written or
    planned for another. With ``cluster.backend: ray`` the workers pin cores of the nodes Ray places them
    on, not this machine's: nothing is checked here.

    Raises:
        ConfigError: naming the key, the cores and the cores this process may use.
    """
    if cfg.cluster.backend != "local":
        return
    allowed = set(available_cpus() if usable is None else usable)
    for key in ("prefill_cpus", "decode_cpus"):
        bad = [core for core in getattr(cfg.compute, key) if core not in allowed]
        if bad:
            what = f"core {bad[0]} is not one" if len(bad) == 1 else f"cores {', '.join(map(str, bad))} are not ones"
            raise ConfigError(f"compute.{key}: {what} this process may run on (usable: {core_ranges(allowed)})")


def core_ranges(cores: Iterable[int]) -> str:
    """``cores`` as sorted ranges, e.g. ``0-3,6,8-9`` (``none`` when empty)."""
    runs: list[list[int]] = []
    for core in sorted(set(cores)):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs) or "none"


def worker_device(cfg: ServiceConfig, role: Role, index: int) -> str:
    """``cuda:N`` from ``compute.prefill_gpus`` (prefill, colocated) or ``decode_gpus``, else ``cpu``."""
    gpus = cfg.compute.prefill_gpus if role.prefills else cfg.compute.decode_gpus
    return f"cuda:{gpus[index]}" if gpus else "cpu"


def prefill_nice(compute: ComputeConfig, cpus: list[int], decode_cpus: list[int]) -> int:
    """Niceness of a prefill worker pinned to ``cpus``: ``compute.prefill_worker_nice`` when it
    shares a core with a decode worker (or either side is unpinned, so the OS may put them on
    one core), else ``compute.worker_nice``. A prefill worker with a core of its own has no
    decode worker to yield to; niced, it would only yield to the API process and to others."""
    if compute.prefill_worker_nice is None:
        return compute.worker_nice
    shares = not cpus or not decode_cpus or bool(set(cpus) & set(decode_cpus))
    return compute.prefill_worker_nice if shares else compute.worker_nice


def build_worker_specs(
    model_dir: Path, cfg: ServiceConfig, model: ModelConfig, rings: list[RingSpec], run_dir: Path,
    output_address: str,
) -> list[WorkerSpec]:
    """Specs for N prefill + M decode workers (or one colocated worker), with cores assigned.

    Rings are ordered prefill-major: ring ``p * M + d`` joins prefill ``p`` and decode ``d``.
    """
    del model  # shapes are already in the ring specs
    compute = cfg.compute
    bells = [doorbell_address(str(run_dir), d) for d in range(compute.decode_workers)]

    def spec(role: Role, index: int, tag: str, rings_of: list[RingSpec], cpus: list[int],
             nice: int = compute.worker_nice) -> WorkerSpec:
        return WorkerSpec(
            role=role, index=index, model_dir=str(model_dir), sizing=engine_sizing(cfg, worker_device(cfg, role, index)),
            control_address=f"ipc://{run_dir}/ctl-{tag}", output_address=output_address, rings=rings_of,
            doorbell_address=doorbell_address(str(run_dir), index) if role is Role.DECODE else "",
            doorbells=bells if role is Role.PREFILL else [],
            cpus=cpus, threads=compute.threads_per_worker, parent_pid=os.getpid(),
            nice=nice,
            handoff_checksum=cfg.fault.handoff_checksum,
        )

    if cfg.mode == "colocated":
        cpus = compute.prefill_cpus + [c for c in compute.decode_cpus if c not in compute.prefill_cpus]
        return [spec(Role.COLOCATED, 0, "c0", [], cpus)]
    n, m = compute.prefill_workers, compute.decode_workers
    prefill_cpus, decode_cpus = compute.prefill_cpus, compute.decode_cpus
    if not prefill_cpus and not decode_cpus:
        prefill_cpus, decode_cpus = default_role_cpus(n, m)
    specs = [spec(Role.PREFILL, p, f"p{p}", [rings[p * m + d] for d in range(m)], cpus,
                  prefill_nice(compute, cpus, decode_cpus))
             for p, cpus in enumerate(split_cpus(prefill_cpus, n))]
    specs += [spec(Role.DECODE, d, f"d{d}", [rings[p * m + d] for p in range(n)], cpus)
              for d, cpus in enumerate(split_cpus(decode_cpus, m))]
    return specs
