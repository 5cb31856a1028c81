"""Placement: which GPUs each instance gets, and replication of a unit over the cluster.

GPU ids are global and node-major: GPU ``g`` is local GPU ``g % gpus_per_node`` of
node ``g // gpus_per_node``. A *unit* is ``n`` prefill instances plus ``m`` decode
instances, the smallest block whose per-GPU goodput the search optimises; the
cluster runs as many copies of it as fit (DistServe Algorithm 1, last lines).

* High node-affinity (Algorithm 1): each instance's stages go to one node when the
  instance fits in one, else stage by stage over nodes; instances never share GPUs.
* Low node-affinity (Algorithm 2): a unit occupies a group of ``pp`` nodes; node
  ``k`` of the group holds stage ``k`` of every instance of the unit, so a prefill
  stage and its decode partner's stage always share a node and KV moves over NVLink.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from mm_serve.planner.latency_model import ParallelConfig

Role = Literal["prefill", "decode", "colocated"]


@dataclass(frozen=True)
class InstancePlacement:
    """One instance: its role, parallelism and global GPU ids (stage-major)."""

    role: Role
    par: ParallelConfig
    gpus: tuple[int, ...]
    gpus_per_node: int

    @property
    def nodes(self) -> tuple[int, ...]:
        """Nodes used, ascending."""
        return tuple(sorted({g // self.gpus_per_node for g in self.gpus}))

    def same_nodes(self, other: InstancePlacement) -> bool:
        """Whether both instances live on exactly the same nodes (KV stays on NVLink)."""
        return self.nodes == other.nodes


@dataclass(frozen=True)
class Unit:
    """``num_prefill`` prefill instances with ``prefill`` parallelism plus
    ``num_decode`` decode instances with ``decode`` parallelism."""

    prefill: ParallelConfig
    decode: ParallelConfig
    num_prefill: int
    num_decode: int

    @property
    def gpus(self) -> int:
        return self.num_prefill * self.prefill.gpus + self.num_decode * self.decode.gpus

    def roles(self) -> list[tuple[Role, ParallelConfig]]:
        """Instances in placement order: prefill first, then decode."""
        pre: list[tuple[Role, ParallelConfig]] = [("prefill", self.prefill)] * self.num_prefill
        dec: list[tuple[Role, ParallelConfig]] = [("decode", self.decode)] * self.num_decode
        return pre + dec


class GpuPool:
    """Free GPUs of a ``nodes x gpus_per_node`` cluster."""

    def __init__(self, nodes: int, gpus_per_node: int) -> None:
        self.gpus_per_node = gpus_per_node
        self.free = [list(range(n * gpus_per_node, (n + 1) * gpus_per_node)) for n in range(nodes)]

    def take(self, par: ParallelConfig) -> tuple[int, ...] | None:
        """Allocate ``par.gpus`` GPUs: one node if any node has room for the whole
        instance, else ``par.tp`` GPUs of one node per stage; None if impossible
        (nothing is allocated then)."""
        whole = next((f for f in self.free if len(f) >= par.gpus), None)
        if whole is not None:
            taken = whole[: par.gpus]
            del whole[: par.gpus]
            return tuple(taken)
        if par.gpus <= self.gpus_per_node:
            return None  # would straddle nodes although it fits in one
        plan: list[tuple[int, int]] = []
        room = [len(f) for f in self.free]
        for _ in range(par.pp):
            node = next((i for i, r in enumerate(room) if r >= par.tp), None)
            if node is None:
                return None
            plan.append((node, par.tp))
            room[node] -= par.tp
        taken_all: list[int] = []
        for node, count in plan:
            taken_all += self.free[node][:count]
            del self.free[node][:count]
        return tuple(taken_all)


def place_unit(unit: Unit, pool: GpuPool) -> list[InstancePlacement] | None:
    """Place one unit (high affinity) into ``pool``; None, and ``pool`` untouched, if
    it does not fit."""
    saved = [list(f) for f in pool.free]
    out = []
    for role, par in unit.roles():
        gpus = pool.take(par)
        if gpus is None:
            pool.free = saved
            return None
        out.append(InstancePlacement(role, par, gpus, pool.gpus_per_node))
    return out


def place_group(unit: Unit, first_node: int, gpus_per_node: int) -> list[InstancePlacement]:
    """Place one unit (low affinity) on nodes ``first_node .. first_node + pp - 1``:
    stage ``k`` of every instance on node ``first_node + k``. The unit's instances must
    share the pipeline degree and fit one node per stage."""
    pp = unit.prefill.pp
    if unit.decode.pp != pp:
        raise ValueError("low-affinity units need equal prefill and decode pipeline degrees")
    per_node = unit.num_prefill * unit.prefill.tp + unit.num_decode * unit.decode.tp
    if per_node > gpus_per_node:
        raise ValueError(f"unit needs {per_node} GPUs per node, nodes have {gpus_per_node}")
    out, offset = [], 0
    for role, par in unit.roles():
        gpus = tuple((first_node + k) * gpus_per_node + offset + i
                     for k in range(pp) for i in range(par.tp))
        out.append(InstancePlacement(role, par, gpus, gpus_per_node))
        offset += par.tp
    return out


def replicate(
    unit: Unit, nodes: int, gpus_per_node: int, affinity: Literal["high", "low"]
) -> tuple[list[InstancePlacement], int]:
    """Copies of ``unit`` over the cluster; returns (instances, number of units)."""
    if affinity == "low":
        groups = nodes // unit.prefill.pp
        out = [p for g in range(groups)
               for p in place_group(unit, g * unit.prefill.pp, gpus_per_node)]
        return out, groups
    pool = GpuPool(nodes, gpus_per_node)
    out, count = [], 0
    while (placed := place_unit(unit, pool)) is not None:
        out += placed
        count += 1
    return out, count


def colocated_replicas(
    par: ParallelConfig, nodes: int, gpus_per_node: int
) -> list[InstancePlacement]:
    """As many colocated instances with ``par`` as the cluster holds."""
    pool = GpuPool(nodes, gpus_per_node)
    out = []
    while (gpus := pool.take(par)) is not None:
        out.append(InstancePlacement("colocated", par, gpus, gpus_per_node))
    return out


def unit_handoff_pairs(instances: Sequence[InstancePlacement]) -> list[list[bool]]:
    """``cross[p][d]``: whether prefill ``p``'s KV to decode ``d`` leaves the node(s)."""
    pre = [i for i in instances if i.role == "prefill"]
    dec = [i for i in instances if i.role == "decode"]
    return [[not p.same_nodes(d) for d in dec] for p in pre]
