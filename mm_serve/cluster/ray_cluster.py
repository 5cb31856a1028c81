"""The front end's connection to a Ray cluster, and which node a placement key names.

Placement is by **custom resource**: node ``i`` of ``cluster.prefill_nodes`` /
``cluster.decode_nodes`` is the Ray node started with the resource
``<cluster.node_resource>_<i>`` (``ray start --resources '{"mm_serve_node_0": 1000}'``);
a worker asks for one unit of it. Custom resources, not node ids (random on each
``ray start``, so a config could not name them) and not node labels (Ray's label
scheduling is newer and not in every version the service supports): any Ray version
schedules by them, ``ray.cluster_utils.Cluster`` and ``ray start`` both set them, and the
planner's node indices map onto them one to one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from mm_serve.config import ClusterConfig, ConfigError
from mm_serve.ground.roles import Role


@dataclass
class RayCluster:
    """A connected driver: Ray namespace, this node's id and address, the nodes by index."""

    config: ClusterConfig
    namespace: str
    driver_node_id: str
    host: str  # where the front end binds its worker sockets
    owns_connection: bool  # this object called ray.init (and so disconnects)

    @classmethod
    def connect(cls, config: ClusterConfig, namespace: str) -> RayCluster:
        """Join the cluster at ``config.address`` (or use the connection this process already has).

        Raises:
            ConfigError: ``ray`` is not installed, or the cluster cannot be reached.
        """
        # Ray's crash-signal handler in a driver re-raises SIGTERM after our handler ran, which
        # would kill the front end instead of letting it drain (docs/serving.md, "Stopping"); it is
        # read when ray is first imported.
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
        try:
            import ray
        except ImportError:
            raise ConfigError("cluster.backend: ray needs the ray package (pip install 'mm-serve[ray]')") from None
        owns = not ray.is_initialized()
        if owns:
            try:
                ray.init(address=config.address, namespace=namespace, include_dashboard=False,
                         log_to_driver=True, configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ConfigError(f"cluster.address = {config.address!r}: cannot join the Ray cluster: {exc}") from None
        host = config.advertise_host
        if host == "auto":
            host = ray.util.get_node_ip_address()
        return cls(config, namespace, ray.get_runtime_context().get_node_id(), host, owns)

    def node_ids(self) -> dict[int, str]:
        """Node index -> Ray node id, for every alive node that offers a ``<node_resource>_<i>``."""
        import ray

        prefix = f"{self.config.node_resource}_"
        out: dict[int, str] = {}
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            for key in node.get("Resources", {}):
                if key.startswith(prefix) and key[len(prefix):].isdigit():
                    out[int(key[len(prefix):])] = node["NodeID"]
        return out

    def check_placement(self) -> None:
        """Every node index the config names is a node of the cluster.

        Raises:
            ConfigError: naming the key, the index and the resource no node offers.
        """
        known = self.node_ids()
        for role in (Role.PREFILL, Role.DECODE):
            for index in getattr(self.config, f"{role}_nodes"):
                if index not in known:
                    raise ConfigError(
                        f"cluster.{role}_nodes names node {index}, but no node of the Ray cluster offers the "
                        f"resource '{self.resource(index)}' (start it with ray start --resources "
                        f"'{{\"{self.resource(index)}\": 1000}}')")

    def resource(self, index: int) -> str:
        """The custom resource that names node ``index``."""
        return f"{self.config.node_resource}_{index}"

    def resources(self, node: int | None) -> dict[str, float]:
        """What a worker placed on ``node`` (None: anywhere) asks Ray for."""
        return {} if node is None else {self.resource(node): 1.0}

    def is_driver_node(self, node: int | None) -> bool:
        """Whether node index ``node`` is the node the front end runs on."""
        return node is not None and self.node_ids().get(node) == self.driver_node_id

    def disconnect(self) -> None:
        """Leave the cluster if :meth:`connect` joined it (Ray ends this driver's actors)."""
        if self.owns_connection:
            import ray

            ray.shutdown()


def actor_name(namespace: str, role: Role, index: int, generation: int) -> str:
    """Ray actor name of worker (``role``, ``index``) at restart ``generation``."""
    return f"{namespace}-{role}{index}-g{generation}"


def node_of(config: ClusterConfig, role: Role, index: int) -> int | None:
    """Node index of worker (``role``, ``index``), None when the config does not place it."""
    nodes: Any = getattr(config, f"{role}_nodes", [])
    return int(nodes[index]) if nodes else None
