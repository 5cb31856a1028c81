"""What changes when the workers run as Ray actors: addresses, ring transports, specs, spawning.

With ``cluster.backend: ray`` the worker pool keeps its job (sockets, rings, supervision)
and asks this module for the differences:

* **Sockets**: the front end binds its ZeroMQ sockets on TCP at the cluster address of
  its node (``cluster.advertise_host``), a free port each; workers on any node connect.
* **Rings**: a pair whose two workers are placed on the front end's node keeps the
  shared-memory ring (the front end creates and unlinks its segments, as on one
  machine); every other pair hands off over Ray (:mod:`mm_serve.transport.ray_ring`): the
  ring spec names the two actors.
* **Doorbells**: a decode worker on the front end's node binds its ``ipc://`` doorbell as
  before (prefill workers there ring it); one elsewhere binds an ``inproc://`` one that its
  Ray deliveries ring (:meth:`~mm_serve.transport.ray_link.RayLink.wake_with`).
* **Workers**: actors on the node their placement names (a custom resource), no core
  pinning (``compute.threads_per_worker`` threads; 0 = every core of the node), no parent
  check (Ray ends a driver's actors when it goes), ``cuda:0`` of the GPU Ray gives the
  actor when the config lists GPUs.
"""

from __future__ import annotations

import msgspec

from mm_serve.cluster.ray_cluster import RayCluster, actor_name, node_of
from mm_serve.cluster.ray_worker import RayWorkerHandle, start_ray_worker
from mm_serve.config import ServiceConfig
from mm_serve.ground.roles import Role
from mm_serve.runtime.worker_spec import WorkerSpec
from mm_serve.transport.registry import transport_of
from mm_serve.transport.ring_spec import RingSpec


class RayLaunch:
    """The Ray side of one worker pool (namespace = the service instance's name)."""

    def __init__(self, config: ServiceConfig, namespace: str) -> None:
        """Join the cluster and check the placement.

        Raises:
            ConfigError: no ray package, no cluster, or a node index no node offers.
        """
        self.config = config
        self.namespace = namespace
        self.cluster = RayCluster.connect(config.cluster, namespace)
        try:
            self.cluster.check_placement()
        except Exception:
            self.cluster.disconnect()
            raise
        cluster = config.cluster
        self._local = {
            (role, i): self.cluster.is_driver_node(node_of(cluster, role, i))
            for role, n in ((Role.PREFILL, config.compute.prefill_workers), (Role.DECODE, config.compute.decode_workers))
            for i in range(n)
        }

    def bind_address(self) -> str:
        """A ZeroMQ address to bind one front-end socket to (a free TCP port on this node)."""
        return f"tcp://{self.cluster.host}:*"

    def ring(self, spec: RingSpec, p: int, d: int, generations: tuple[int, int]) -> RingSpec:
        """Ring ``spec`` of pair (``p``, ``d``) with its transport: ``spec`` as it is (shared
        memory) when both workers are on the front end's node, else over Ray, naming the
        actors of the two ends at their restart ``generations`` (prefill, decode)."""
        if self._local[(Role.PREFILL, p)] and self._local[(Role.DECODE, d)]:
            return spec
        return msgspec.structs.replace(
            spec, transport="ray", producer=actor_name(self.namespace, Role.PREFILL, p, generations[0]),
            consumer=actor_name(self.namespace, Role.DECODE, d, generations[1]))

    def worker_spec(self, spec: WorkerSpec, rings: list[RingSpec]) -> WorkerSpec:
        """A local-process spec made fit for an actor (see the module docstring); ``rings`` are
        every pair's ring, prefill-major."""
        m = self.config.compute.decode_workers
        sizing = spec.sizing
        if sizing.device.startswith("cuda"):
            sizing = msgspec.structs.replace(sizing, device="cuda:0")
        doorbell, doorbells = spec.doorbell_address, list(spec.doorbells)
        if spec.role is Role.DECODE and not self._local[(Role.DECODE, spec.index)]:
            doorbell = f"inproc://{self.namespace}-bell-d{spec.index}"
        if spec.role is Role.PREFILL:
            doorbells = [bell if transport_of(rings[spec.index * m + d]).same_node else ""
                         for d, bell in enumerate(doorbells)]
        return msgspec.structs.replace(
            spec, sizing=sizing, cpus=[], threads=self.config.compute.threads_per_worker, parent_pid=0,
            doorbell_address=doorbell, doorbells=doorbells)

    def spawn(self, spec: WorkerSpec, generation: int) -> RayWorkerHandle:
        """Start worker ``spec`` as an actor on its node."""
        node = node_of(self.config.cluster, spec.role, spec.index)
        gpus = 1 if spec.sizing.device.startswith("cuda") else 0
        name = actor_name(self.namespace, spec.role, spec.index, generation)
        return start_ray_worker(spec, name, self.namespace, self.cluster.resources(node), gpus)

    def close(self) -> None:
        """Leave the cluster (if the pool joined it)."""
        self.cluster.disconnect()
