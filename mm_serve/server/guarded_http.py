"""uvicorn's h11 protocol with the limits a public HTTP server needs before any request reaches the app.

uvicorn bounds neither the size of a request's head (h11 bounds only a head still arriving, and
uvicorn answers that in plain text) nor the time to receive it (its keep-alive timer stops at the
first byte), and it has no cap on open connections but ``limit_concurrency``'s plain-text 503. This
protocol, a subclass of uvicorn's :class:`~uvicorn.protocols.http.h11_impl.H11Protocol` (h11 still
parses every byte), adds:

- a head (request line and headers) over ``max_header_bytes`` gets 431 ``header_too_large`` and the
  connection is closed, whether it arrives whole or in pieces (nginx's ``large_client_header_buffers``);
- a head not complete ``header_timeout_s`` after the connection opened or its first byte arrived: the
  connection is closed (nginx's ``client_header_timeout``, Apache's ``RequestReadTimeout header=``);
- a request on a connection opened while ``max_connections`` were open gets 429 ``too_many_connections``
  with ``Retry-After`` and the connection is closed;
- malformed HTTP gets a 400 ``malformed_request`` in OpenAI's error JSON, not uvicorn's plain text.

Every answer here closes the connection: nothing after a bad head can be framed.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from mm_serve.protocol.errors import APIError

CONNECTION_RETRY_AFTER_S = 1
LINGER_S = 2.0  # after answering a request whose body is still arriving, how long the rest is discarded


@dataclass(frozen=True)
class HTTPLimits:
    """The limits :func:`guarded_h11` enforces (``api.max_header_bytes``, ``api.header_timeout_s``,
    ``api.max_connections``)."""

    max_header_bytes: int = 32 << 10
    header_timeout_s: float = 10.0
    max_connections: int = 2048


class _BoundedConnection(h11.Connection):
    """h11's server side that also refuses a complete head over ``max_header_bytes`` (h11 itself refuses
    only an incomplete one past it) and, when told, the next request (a connection over the cap);
    :attr:`refusal` keeps the answer for the protocol's error response."""

    def __init__(self, max_header_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_header_bytes)
        self.max_header_bytes = max_header_bytes
        self.refusal: APIError | None = None
        self.refuse_next: APIError | None = None
        self._arrived = 0  # bytes received since this request began (its head first)

    def receive_data(self, data: bytes) -> None:
        self._arrived += len(data)
        super().receive_data(data)

    def start_next_cycle(self) -> None:
        super().start_next_cycle()
        self._arrived = len(self.trailing_data[0])  # a pipelined request's bytes already here

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.refusal = self.refusal or _protocol_error(exc, self.max_header_bytes)
            raise
        if isinstance(event, h11.Request):
            size = self._arrived - len(self.trailing_data[0])  # as sent: whitespace h11 drops counts too
            if size > self.max_header_bytes:
                self.refusal = _too_large(self.max_header_bytes, f"{size} bytes")
            elif self.refuse_next is not None:
                self.refusal = self.refuse_next
            if self.refusal is not None:
                raise h11.RemoteProtocolError(self.refusal.message, error_status_hint=self.refusal.status)
        return event


def _too_large(limit: int, size: str) -> APIError:
    return APIError(431, f"the request line and headers are larger than the limit of {limit} bytes "
                         f"(api.max_header_bytes): {size}", code="header_too_large")


def _protocol_error(exc: h11.RemoteProtocolError, max_header_bytes: int) -> APIError:
    """The answer to what h11 refused: 431 for a head still arriving past the limit, else 400."""
    if exc.error_status_hint == 431:
        return _too_large(max_header_bytes, "more arrived before the blank line that ends them")
    return APIError(exc.error_status_hint if 400 <= exc.error_status_hint < 500 else 400,
                    f"malformed HTTP request: {exc}", code="malformed_request")


class _LingeringTransport:
    """The connection's transport, except that closing it while the client may still be sending a body the app
    did not read (an error answered on the headers) sends the response and a FIN, then discards what still
    arrives for :data:`LINGER_S` before it closes (Apache's lingering close): a close with unread bytes
    would make the kernel reset the connection, and the client could lose the answer. A kept-alive
    connection whose body was left unread is closed so too (:meth:`GuardedH11Protocol.on_response_complete`)."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self.lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.lingering or self._transport.is_closing() or not self._protocol.body_unread():
            if not self.lingering:
                self._transport.close()
            return
        self.lingering = True
        if self._transport.can_write_eof():
            self._transport.write_eof()
        self._transport.resume_reading()  # uvicorn paused it past 64 KiB unread: the rest must flow to be dropped
        self._protocol.loop.call_later(LINGER_S, self._transport.close)


class GuardedH11Protocol(H11Protocol):
    """:class:`H11Protocol` with :class:`HTTPLimits` (set by :func:`guarded_h11`); see the module."""

    limits = HTTPLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bounded = _BoundedConnection(self.limits.max_header_bytes)
        self.conn = self.bounded
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
        if len(self.connections) > self.limits.max_connections:
            self.bounded.refuse_next = APIError(
                429, f"too many open connections: {len(self.connections) - 1} are open and the limit is "
                     f"{self.limits.max_connections} (api.max_connections); retry shortly",
                "rate_limit_error", code="too_many_connections",
                headers={"Retry-After": str(CONNECTION_RETRY_AFTER_S)})
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def body_unread(self) -> bool:
        """Whether the current request's body is still arriving, unread by the app."""
        return self.bounded.their_state is h11.SEND_BODY

    def on_response_complete(self) -> None:
        """uvicorn's, then a lingering close if the request's body is still arriving: the app answered without
        reading it, so the connection cannot serve another request."""
        super().on_response_complete()
        if self.body_unread() and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():  # lingering: what still arrives is discarded
            return
        if self.conn.their_state is h11.IDLE and self._head_timer is None:
            self._arm_head_timer()  # the first byte of a head on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._stop_head_timer()

    def _arm_head_timer(self) -> None:
        self._stop_head_timer()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a refused head or body, as OpenAI's error JSON with the refusal's status. A request
        whose app is already running (a bad chunk after the head) has its app's answer dropped, or, when that
        answer has begun, the connection is just closed."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started:
                self.transport.close()
                return
            cycle.disconnected = True  # what the app sends now goes nowhere
            cycle.message_event.set()
        error = self.bounded.refusal or APIError(400, f"malformed HTTP request: {msg}", code="malformed_request")
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        headers += [(name.lower().encode("latin-1"), value.encode("latin-1"))
                    for name, value in error.response_headers().items()]
        for event in (h11.Response(status_code=error.status, headers=headers, reason=STATUS_PHRASES[error.status]),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def guarded_h11(limits: HTTPLimits) -> type[GuardedH11Protocol]:
    """A :class:`GuardedH11Protocol` class with ``limits``, for ``uvicorn.Config(http=...)``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
