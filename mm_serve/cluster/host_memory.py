"""Refuse, before any worker starts, KV caches that cannot fit this machine's memory.

A CPU worker allocates its whole KV pool at start (``kv_cache.max_pages_per_gpu`` pages), and the
rings' page pools live in shared memory beside them. Past the host's memory the kernel's
out-of-memory killer ends a worker with SIGKILL mid-load, with nothing in its log; checked here, the
start fails at once with the sizes and the key to lower.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from mm_serve.cluster.ring_sizing import kv_page_shape
from mm_serve.cluster.worker_state import WorkerStartError
from mm_serve.config import ServiceConfig
from mm_serve.ground.dtypes import DTYPE_BYTES
from mm_serve.models.model_config import ModelConfig
from mm_serve.transport.ring_spec import RingSpec

USABLE_SHARE = 0.8  # of the memory available now: the rest for the weights, activations and the front end
MEMINFO = Path("/proc/meminfo")


def available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; None where it cannot be read (not Linux)."""
    return _meminfo_bytes("MemAvailable", meminfo)


def total_bytes(meminfo: Path = MEMINFO) -> int | None:
    """``MemTotal`` of ``/proc/meminfo`` (this machine's memory) in bytes; None where it cannot be read."""
    return _meminfo_bytes("MemTotal", meminfo)


def _meminfo_bytes(field: str, meminfo: Path) -> int | None:
    """The ``field`` line of ``/proc/meminfo`` (given in kB there) in bytes; None where it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_kv_bytes(cfg: ServiceConfig, model: ModelConfig, rings: Sequence[RingSpec]) -> tuple[int, int, int]:
    """``(workers, pool bytes of each, ring bytes)`` that this machine's memory holds: the KV pools of the
    workers that run on the CPU (a colocated one, or each prefill and decode worker without GPUs) and the
    rings' page pools (shared memory, here whatever the workers' devices)."""
    page = math.prod(kv_page_shape(model, cfg.kv_cache.page_size)) * DTYPE_BYTES[cfg.serving_dtype(model.raw)]
    compute = cfg.compute
    if cfg.mode == "colocated":
        workers = 0 if compute.uses_gpus else 1
    else:
        workers = ((0 if compute.prefill_gpus else compute.prefill_workers)
                   + (0 if compute.decode_gpus else compute.decode_workers))
    return workers, cfg.kv_cache.max_pages_per_gpu * page, sum(r.num_pages * r.page_bytes for r in rings)


def check_host_memory(cfg: ServiceConfig, model: ModelConfig, rings: Sequence[RingSpec],
                      available: int | None = None) -> None:
    """Raise when the KV of :func:`host_kv_bytes` is over :data:`USABLE_SHARE` of ``available`` bytes
    (default: :func:`available_bytes`; nothing is checked where it is unknown).

    Raises:
        WorkerStartError: naming the sizes, the memory available and ``kv_cache.max_pages_per_gpu``.
    """
    available = available_bytes() if available is None else available
    workers, pool, ring = host_kv_bytes(cfg, model, rings)
    needed = workers * pool + ring
    if available is None or needed <= USABLE_SHARE * available:
        return
    gib = 2**30
    raise WorkerStartError(
        f"the KV caches need {needed / gib:.1f} GiB ({workers} CPU worker(s) x {pool / gib:.2f} GiB for "
        f"kv_cache.max_pages_per_gpu = {cfg.kv_cache.max_pages_per_gpu} pages, plus {ring / gib:.2f} GiB of "
        f"rings), over {USABLE_SHARE:.0%} of the {available / gib:.1f} GiB this machine has available: lower "
        "kv_cache.max_pages_per_gpu (and kv_cache.ring_pages)", user_error=True)
