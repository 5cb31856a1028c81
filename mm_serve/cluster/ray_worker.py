"""A worker as a Ray actor, and the handle the worker pool supervises it by.

The actor runs the same :class:`~mm_serve.runtime.worker_shell.WorkerShell` as a local
worker process (:mod:`mm_serve.cluster.worker_main`): its ``serve`` method builds the role's
worker from the :class:`WorkerSpec` and loops until ``Shutdown``, talking to the front end
over ZeroMQ (TCP). The actor is threaded (``max_concurrency``): while ``serve`` runs on one
thread, Ray runs ``deliver`` / ``released`` (the hand-off transport between actors on
different nodes, :mod:`mm_serve.transport.ray_ring`) on others; they meet in a
:class:`~mm_serve.transport.ray_link.RayLink`.

:class:`RayWorkerHandle` gives the pool what it uses of ``subprocess.Popen``: ``pid``,
``poll``, ``kill`` and ``wait`` (which also frees the actor once ``serve`` returned).
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

from mm_serve.runtime.worker_spec import WorkerSpec, decode_spec, encode_spec
from mm_serve.transport.ray_link import RayLink

ACTOR_THREADS = 4  # serve + concurrent deliver / released / info calls
KILLED_CODE = -9  # what poll() reports for an actor that died (killed, node lost, crashed hard)


class RayWorker:
    """The Ray actor class of one worker (decorated with ``ray.remote`` when started)."""

    def __init__(self, spec_json: str, namespace: str) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._spec = decode_spec(spec_json)
        self._link = RayLink(namespace)

    def info(self) -> tuple[int, str]:
        """This actor's process id and Ray node id."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def serve(self) -> int:
        """Build the role's worker and serve until Shutdown: 0; 1 on a crash (traceback printed:
        Ray forwards it to the front end's stderr)."""
        from mm_serve.cluster.worker_main import run_worker

        spec = self._spec
        if not spec.threads and not spec.cpus:
            import torch

            torch.set_num_threads(len(os.sched_getaffinity(0)))  # Ray sets 1 for a 0-CPU actor
        return run_worker(spec, self._link)

    def deliver(self, ring: str, record: bytes, refs: list[Any]) -> None:
        """A hand-off published to this (decode) actor: see :meth:`RayLink.deliver`."""
        self._link.deliver(ring, record, refs)

    def released(self, ring: str, seq: int) -> None:
        """A hand-off of this (prefill) actor released by its consumer: see :meth:`RayLink.released`."""
        self._link.released(ring, seq)


class RayWorkerHandle:
    """The pool's view of one worker actor (the subset of ``subprocess.Popen`` it uses)."""

    def __init__(self, actor: Any, name: str) -> None:
        self.actor = actor
        self.name = name
        self._serve = actor.serve.remote()
        self._info = actor.info.remote()
        self._pid = 0
        self.node_id = ""
        self._code: int | None = None

    @property
    def pid(self) -> int:
        """The actor's process id once it is known (the actor has started), else 0."""
        if not self._pid:
            import ray

            ready, _ = ray.wait([self._info], timeout=0)
            if ready:
                try:
                    self._pid, self.node_id = ray.get(self._info)
                except ray.exceptions.RayError:
                    self._pid = -1
        return max(self._pid, 0)

    def poll(self) -> int | None:
        """The exit code once ``serve`` has ended (:data:`KILLED_CODE` if the actor died), else None."""
        import ray

        if self._code is None:
            ready, _ = ray.wait([self._serve], timeout=0)
            if ready:
                self._code = self._result()
        return self._code

    def kill(self) -> None:
        """End the actor now (its process and what it held)."""
        import ray

        ray.kill(self.actor, no_restart=True)

    def wait(self, timeout: float | None = None) -> int:
        """Wait up to ``timeout`` seconds for ``serve`` to end, then free the actor.

        Raises:
            subprocess.TimeoutExpired: it has not ended (as ``Popen.wait``).
        """
        import ray

        if self._code is None:
            ready, _ = ray.wait([self._serve], timeout=timeout)
            if not ready:
                raise subprocess.TimeoutExpired(self.name, timeout or 0.0)
            self._code = self._result()
        ray.kill(self.actor, no_restart=True)
        return self._code

    def _result(self) -> int:
        import ray

        try:
            return int(ray.get(self._serve))
        except ray.exceptions.RayActorError:
            return KILLED_CODE
        except ray.exceptions.RayError:
            return 1


def start_ray_worker(spec: WorkerSpec, name: str, namespace: str, resources: dict[str, float],
                     num_gpus: int) -> RayWorkerHandle:
    """Create worker actor ``name`` (in ``namespace``) where ``resources`` say, and start its loop.

    The actor is not detached: Ray ends it when the front end's driver disconnects.
    """
    import ray

    actor_class = ray.remote(RayWorker)
    actor = actor_class.options(  # type: ignore[attr-defined]
        name=name, namespace=namespace, resources=resources, num_cpus=0, num_gpus=num_gpus,
        max_concurrency=ACTOR_THREADS, max_restarts=0,
    ).remote(encode_spec(spec), namespace)
    return RayWorkerHandle(actor, name)
