"""The front end's ZeroMQ sockets to its workers: one PUSH per worker for control messages,
one PULL for every worker's reports.

The front end binds, the workers connect: ``ipc://`` addresses in the run directory on
one machine, a free TCP port each with ``cluster.backend: ray``. Sends never block
(``SNDHWM`` 0 while a worker is connected; a socket with no peer refuses at once).
Not thread-safe: the worker pool serialises sends under its lock, and reads from one
thread at a time.
"""

from __future__ import annotations

import msgspec
import zmq

from mm_serve.cluster.worker_state import WorkerKey
from mm_serve.runtime import messages

_DECODER = messages.decoder(messages.FromWorker)


class ControlSockets:
    """The control PUSH socket of each worker (by key) and the shared report PULL socket."""

    def __init__(self) -> None:
        self._ctx: zmq.Context = zmq.Context.instance()  # type: ignore[type-arg]
        self._controls: dict[WorkerKey, zmq.Socket] = {}  # type: ignore[type-arg]
        self._reports: zmq.Socket | None = None  # type: ignore[type-arg]

    def bind_reports(self, address: str) -> str:
        """Bind the report socket at ``address`` (``tcp://host:*``: a free port); returns the
        address as bound, for the workers' specs."""
        self._reports = self._ctx.socket(zmq.PULL)
        self._reports.bind(address)
        return str(self._reports.getsockopt_string(zmq.LAST_ENDPOINT))

    def bind_control(self, key: WorkerKey, address: str) -> str:
        """Bind worker ``key``'s control socket at ``address`` (closing the one it had); returns
        the address as bound."""
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # never mute while the worker is connected: sends do not block
        sock.bind(address)
        old = self._controls.pop(key, None)
        if old is not None:
            old.close(linger=0)
        self._controls[key] = sock
        return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))

    def send(self, key: WorkerKey, msg: msgspec.Struct) -> bool:
        """Queue ``msg`` for worker ``key``; False when its socket has no peer (not delivered).

        Raises:
            KeyError: no control socket was bound for ``key``.
        """
        try:
            self._controls[key].send(messages.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def recv(self, timeout_ms: int) -> object | None:
        """The next report from any worker, waiting up to ``timeout_ms``; None on timeout or an
        undecodable frame.

        Raises:
            RuntimeError: before :meth:`bind_reports`.
        """
        if self._reports is None:
            raise RuntimeError("recv before the report socket is bound")
        if not self._reports.poll(timeout_ms):
            return None
        try:
            return _DECODER.decode(self._reports.recv())
        except msgspec.DecodeError:
            return None

    def broadcast_shutdown(self) -> None:
        """Send :class:`~mm_serve.runtime.messages.Shutdown` to every connected worker."""
        for sock in self._controls.values():
            try:
                sock.send(messages.encode(messages.Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def close(self) -> None:
        """Close every socket."""
        for sock in self._controls.values():
            sock.close(linger=0)
        if self._reports is not None:
            self._reports.close(linger=0)
