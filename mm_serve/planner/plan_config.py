"""Write a chosen placement as a ``configs/`` YAML that ``mm-serve serve`` accepts.

The file is built as a plain dict, validated by :func:`mm_serve.config.config_from_dict`,
rendered by :func:`mm_serve.config.dump_config` and read back with
:func:`mm_serve.config.load_config` before this module reports success.

GPU ids are written node-major and global (``node * gpus_per_node + local id``); a
header comment says so. On a single node they are the CUDA device ids. A plan over more
than one node also writes the ``cluster`` section: ``backend: ray`` and the node index of
every instance (``cluster.prefill_nodes`` / ``decode_nodes``, its first node when it
spans several), which the Ray backend maps to nodes by custom resource; there each worker
gets one GPU from Ray. ``device="cpu"`` writes no GPU ids: the planned devices are CPU
worker slots (a plan from an ``mm-serve profile`` of a CPU machine), and no KV page count (the
planner's is per GPU; on a CPU every worker's pool comes out of the host's memory).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mm_serve.config import ConfigError, ServiceConfig, config_from_dict, dump_config, load_config
from mm_serve.planner.errors import PlannerError
from mm_serve.planner.memory import memory_plan
from mm_serve.planner.search import PlanResult

PAGE_SIZE = 16  # tokens per KV page written to kv_cache.page_size
_MAX_WORKERS = 64  # compute.*_workers limit of mm_serve.config
_MAX_PAGES = 1 << 24


def placement_dict(result: PlanResult, model: str, device: str = "cuda") -> dict[str, Any]:
    """The config tree of ``result``'s disaggregated placement (not yet validated); ``device``
    ``cpu`` lists no GPUs."""
    spec = result.spec
    pre = [i for i in result.placement if i.role == "prefill"]
    dec = [i for i in result.placement if i.role == "decode"]
    for role, insts in (("prefill", pre), ("decode", dec)):
        if len(insts) > _MAX_WORKERS:
            raise PlannerError(f"{len(insts)} {role} instances exceed the config limit of "
                               f"{_MAX_WORKERS} (compute.{role}_workers)")
    kv = memory_plan(spec.shape, spec.hardware, result.unit.decode, vision=False)
    pages = max(4, min(_MAX_PAGES, kv.kv_capacity_tokens // PAGE_SIZE))
    gpus = device != "cpu"
    tree: dict[str, Any] = {
        "model": model,
        "mode": "disaggregated",
        "dtype": spec.shape.dtype,
        "seed": spec.seed,
        "compute": {
            "prefill_workers": len(pre),
            "decode_workers": len(dec),
            "prefill_tensor_parallel": result.unit.prefill.tp,
            "prefill_pipeline_parallel": result.unit.prefill.pp,
            "decode_tensor_parallel": result.unit.decode.tp,
            "decode_pipeline_parallel": result.unit.decode.pp,
            "prefill_gpus": [g for i in pre for g in i.gpus] if gpus else [],
            "decode_gpus": [g for i in dec for g in i.gpus] if gpus else [],
        },
        "scheduler": {
            "prefill_batch_size": spec.prefill_max_batch,
            "prefill_token_budget": spec.prefill_token_budget,
            "decode_max_concurrent": spec.decode_max_batch,
        },
        # on a CPU every worker's pool (prefill ones too) comes out of the host's memory: the default there
        "kv_cache": {"page_size": PAGE_SIZE, **({"max_pages_per_gpu": pages} if gpus else {})},
    }
    if spec.nodes > 1:
        tree["cluster"] = {"backend": "ray", "prefill_nodes": [i.nodes[0] for i in pre],
                           "decode_nodes": [i.nodes[0] for i in dec]}
    return tree


def placement_config(result: PlanResult, model: str, device: str = "cuda") -> ServiceConfig:
    """The validated :class:`ServiceConfig` of ``result``.

    Raises:
        PlannerError: the placement cannot be expressed in the config schema.
    """
    try:
        return config_from_dict(placement_dict(result, model, device))
    except ConfigError as exc:
        raise PlannerError(f"placement does not fit the config schema: {exc}") from None


def write_placement_config(result: PlanResult, model: str, path: str | Path, device: str = "cuda") -> ServiceConfig:
    """Write the placement YAML to ``path`` and return it as read back by ``load_config``."""
    cfg = placement_config(result, model, device)
    spec = result.spec
    header = (
        f"# Written by `mm-serve plan`: {spec.shape.name} on {spec.hardware.name}, "
        f"{spec.nodes} x {spec.gpus_per_node} GPUs, affinity {spec.affinity}.\n"
        f"# Goodput {result.per_gpu_goodput:.3f} req/s/GPU at TTFT {spec.slo.ttft_s} s, "
        f"TPOT {spec.slo.tpot_s} s, {spec.attainment:.0%} attainment.\n"
        f"# GPU ids are global and node-major: node = id // {spec.gpus_per_node}, "
        f"CUDA device = id % {spec.gpus_per_node}"
        + (" (with cluster.backend ray each worker uses the GPU Ray gives it).\n" if spec.nodes > 1 else ".\n")
        + ("# --device cpu: the planned devices are CPU worker slots; no GPU ids are written, and\n"
           "# kv_cache.max_pages_per_gpu keeps its default (every worker's KV pool is allocated from this host's memory).\n"
           if device == "cpu" else "")
        + ("# Start the Ray cluster with node i offering the custom resource mm_serve_node_<i> "
           "(docs/multi_node.md).\n" if spec.nodes > 1 else "")
        + (f"# Colocated serving was predicted higher ({result.colocated_per_gpu_goodput:.3f} req/s/GPU, "
           f"{result.ratio:.2f}x): this is the best disaggregated placement;\n# for the better one serve with "
           "mode: colocated (or no placement keys: mm-serve serve then picks).\n"
           if result.ratio < 1 else "")
    )
    p = Path(path)
    try:
        p.write_text(header + dump_config(cfg))
    except OSError as exc:
        raise PlannerError(f"cannot write {p}: {exc.strerror}") from None
    try:
        return load_config(p)
    except ConfigError as exc:
        raise PlannerError(f"written config does not load back: {exc}") from None
