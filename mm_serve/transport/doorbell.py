"""Hand-off doorbells: a prefill worker wakes an idle decode worker when it publishes.

The cross-modal ring lives in shared memory, which no socket can wait on, so an idle
decode worker would otherwise poll the ring every millisecond (2-6 % of a core
while the service does nothing). Each decode worker binds one ZeroMQ PULL socket;
each prefill worker connects one PUSH socket per decode worker and sends an empty
frame after every publish to that worker's ring. The decode worker waits on its
control socket and its doorbell together and claims right after a ring.

Doorbells carry no data and nothing depends on them for correctness: a frame that is
dropped (the decode side not bound yet, or frames already queued) only delays the
claim until the decode worker's idle timeout (``worker_channel.IDLE_WAIT_MS``).
"""

from __future__ import annotations

import zmq


def doorbell_address(run_dir: str, decode_index: int) -> str:
    """The ``ipc://`` address decode worker ``decode_index`` binds its doorbell to."""
    return f"ipc://{run_dir}/bell-d{decode_index}"


class DoorbellListener:
    """Decode side: a bound PULL socket; :attr:`socket` is what a poller waits on."""

    def __init__(self, address: str) -> None:
        ctx: zmq.Context = zmq.Context.instance()  # type: ignore[type-arg]
        self.socket = ctx.socket(zmq.PULL)
        self.socket.bind(address)

    def drain(self) -> int:
        """Discard every pending ring; returns how many there were."""
        count = 0
        while True:
            try:
                self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return count
            count += 1

    def close(self) -> None:
        self.socket.close(linger=0)


class DoorbellRingers:
    """Prefill side: one PUSH socket per decode worker, in decode order (none where the
    address is empty: a decode worker on another node, woken by its Ray deliveries instead)."""

    def __init__(self, addresses: list[str]) -> None:
        ctx: zmq.Context = zmq.Context.instance()  # type: ignore[type-arg]
        self._sockets: list[zmq.Socket | None] = []  # type: ignore[type-arg]
        for address in addresses:
            if not address:
                self._sockets.append(None)
                continue
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 2)  # one queued ring wakes the worker; more add nothing
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self._sockets.append(sock)

    def ring(self, decode_index: int) -> None:
        """Wake decode worker ``decode_index`` (never blocks; a full queue drops it).

        Raises:
            IndexError: no doorbell for that index.
        """
        sock = self._sockets[decode_index]
        if sock is None:
            return
        try:
            sock.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass

    def close(self) -> None:
        for sock in self._sockets:
            if sock is not None:
                sock.close()
