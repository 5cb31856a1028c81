"""What a worker process needs to start: role, model, sizing, sockets, rings, cores.

The launcher serialises a :class:`WorkerSpec` to JSON on the worker's command
line; nothing else crosses the process boundary at start-up.
"""

from __future__ import annotations

import msgspec

from mm_serve.ground.roles import Role
from mm_serve.runtime.engine_config import EngineConfig
from mm_serve.transport.ring_spec import RingSpec


class WorkerSpec(msgspec.Struct, frozen=True):
    """Start-up description of one worker process."""

    role: Role
    index: int
    model_dir: str
    sizing: EngineConfig
    control_address: str  # the worker connects a PULL socket here (the front end binds PUSH)
    output_address: str  # the worker connects a PUSH socket here (the front end binds PULL)
    rings: list[RingSpec] = []  # prefill: one per decode worker, in decode order; decode: one per prefill worker
    doorbell_address: str = ""  # decode: binds its hand-off doorbell here (see runtime.doorbell)
    doorbells: list[str] = []  # prefill: each decode worker's doorbell, in decode order
    cpus: list[int] = []  # cores to pin to; empty = no pinning
    threads: int = 0  # torch intra-op threads; 0 = len(cpus) or torch's default
    nice: int = 0  # niceness added to the worker process (compute.worker_nice)
    parent_pid: int = 0  # exit if this process disappears (no orphans)
    stats_interval_s: float = 0.5  # also the heartbeat: the pool replaces a worker silent for fault.heartbeat_timeout_s
    handoff_checksum: bool = True  # fault.handoff_checksum: CRC-32 of each hand-off's pages and features

    def __post_init__(self) -> None:
        """A role given as its string (``"prefill"``) becomes the :class:`Role`; raises
        ``ValueError`` for an unknown role."""
        if not isinstance(self.role, Role):
            msgspec.structs.force_setattr(self, "role", Role(self.role))


def encode_spec(spec: WorkerSpec) -> str:
    """JSON text of ``spec`` (for the command line)."""
    return msgspec.json.encode(spec).decode()


def decode_spec(text: str) -> WorkerSpec:
    """Parse :func:`encode_spec` output; raises ``msgspec.ValidationError`` on bad input."""
    return msgspec.json.decode(text, type=WorkerSpec)
