"""A worker's two ZeroMQ sockets: typed control messages in, typed reports out."""

from __future__ import annotations

import os
import time

import msgspec
import zmq

from mm_serve.ground.console import say
from mm_serve.runtime import messages
from mm_serve.transport.doorbell import DoorbellListener

# Longest an idle worker waits in ``recv`` before its periodic chores (stats, the
# parent check): control messages and doorbells end the wait at once.
IDLE_WAIT_MS = 100


class WorkerChannel:
    """PULL for control messages from the front end, PUSH for reports to it.

    ``recv`` decodes with the worker's message union, so anything that is not one
    of its typed messages is rejected (logged and dropped), never executed; a
    rejected message that names a ``request_id`` fails that request.
    """

    def __init__(self, control_address: str, output_address: str, kind: object, parent_pid: int = 0) -> None:
        self._ctx: zmq.Context = zmq.Context.instance()  # type: ignore[type-arg]
        self._in = self._ctx.socket(zmq.PULL)
        self._in.connect(control_address)
        self._out = self._ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.LINGER, 2000)
        self._out.connect(output_address)
        self._decoder = messages.decoder(kind)
        self._parent_pid = parent_pid
        self._next_parent_check = 0.0
        self._poller = zmq.Poller()
        self._poller.register(self._in, zmq.POLLIN)
        self._doorbell: DoorbellListener | None = None

    def listen_to(self, doorbell: DoorbellListener) -> None:
        """Let a ring of ``doorbell`` end :meth:`recv`'s wait too (it is drained there)."""
        self._doorbell = doorbell
        self._poller.register(doorbell.socket, zmq.POLLIN)

    def send(self, message: msgspec.Struct) -> None:
        self._out.send(messages.encode(message), copy=False)

    def recv(self, timeout_ms: int) -> list[object]:
        """Every pending message, waiting up to ``timeout_ms`` for the first one or
        a doorbell ring (see :meth:`listen_to`)."""
        out: list[object] = []
        ready = dict(self._poller.poll(timeout_ms))
        if self._doorbell is not None and self._doorbell.socket in ready:
            self._doorbell.drain()
        if self._in not in ready:
            return out
        while True:
            try:
                frame = self._in.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(self._decoder.decode(frame))
            except msgspec.DecodeError as exc:
                say(f"[worker {os.getpid()}] dropped malformed control message: {exc}")
                self._fail_request_of(frame, exc)

    def _fail_request_of(self, frame: bytes, exc: Exception) -> None:
        """Tell the front end a request it sent could not be decoded, so its caller is not left waiting."""
        try:
            raw = msgspec.msgpack.decode(frame)
        except msgspec.DecodeError:
            return
        request_id = raw.get("request_id") if isinstance(raw, dict) else None
        if isinstance(request_id, str):
            self.send(messages.RequestFailed(request_id, f"the worker could not decode the request: {exc}"))

    def parent_alive(self) -> bool:
        """False once the launching process has gone (checked at most once a second)."""
        if not self._parent_pid:
            return True
        now = time.monotonic()
        if now < self._next_parent_check:
            return True
        self._next_parent_check = now + 1.0
        return os.getppid() == self._parent_pid

    def close(self) -> None:
        self._in.close(linger=0)
        self._out.close()
