"""What a worker process needs to start: role, model, sizing, sockets, rings, cores.

The launcher serialises a :class:`WorkerSpec` to JSON on the worker's command
line; nothing else crosses the process boundary at start-up.
"""

from __future__ import annotations

import msgspec

from kernels.ring_spec import RingSpec


class EngineSizing(msgspec.Struct, frozen=True):
    """The :class:`~mm_serve.engine.engine_config.EngineConfig` fields, on the wire."""

    page_size: int = 16
    num_pages: int = 2048
    max_running: int = 64
    prefill_token_budget: int = 4096
    prefill_batch_size: int = 8
    max_model_len: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    enforce_eager: bool = False
    cpu_gemm: str = "onednn"
    cpu_kernels: str = "compiled"


class WorkerSpec(msgspec.Struct, frozen=True):
    """Start-up description of one worker process."""

    role: str  # "prefill" | "decode" | "colocated"
    index: int
    model_dir: str
    sizing: EngineSizing
    control_address: str  # the worker connects a PULL socket here (the front end binds PUSH)
    output_address: str  # the worker connects a PUSH socket here (the front end binds PULL)
    rings: list[RingSpec] = []  # prefill: one per decode worker, in decode order; decode: one per prefill worker
    doorbell_address: str = ""  # decode: binds its hand-off doorbell here (see engine.doorbell)
    doorbells: list[str] = []  # prefill: each decode worker's doorbell, in decode order
    cpus: list[int] = []  # cores to pin to; empty = no pinning
    threads: int = 0  # torch intra-op threads; 0 = len(cpus) or torch's default
    parent_pid: int = 0  # exit if this process disappears (no orphans)
    stats_interval_s: float = 0.5


def encode_spec(spec: WorkerSpec) -> str:
    """JSON text of ``spec`` (for the command line)."""
    return msgspec.json.encode(spec).decode()


def decode_spec(text: str) -> WorkerSpec:
    """Parse :func:`encode_spec` output; raises ``msgspec.ValidationError`` on bad input."""
    return msgspec.json.decode(text, type=WorkerSpec)
