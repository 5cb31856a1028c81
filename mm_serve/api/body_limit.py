"""The body middleware: refuse bodies over ``max_body_bytes`` with 413 before parsing; count the
bodies being read against the image budget, within read timeouts."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

from mm_serve.admission.byte_budget import IMAGE_RETRY_AFTER_S, ByteBudget
from mm_serve.admission.rejection import Rejection
from mm_serve.api.api_key import keyed_path, scope_authorized, unauthorized
from mm_serve.api.body_hold import AheadByClient, BodyHold
from mm_serve.api.body_spool import BodySpool
from mm_serve.api.error_handlers import error_response
from mm_serve.pipeline.refusal import from_rejection
from mm_serve.protocol.errors import APIError, unavailable

Scope = dict[str, Any]
BODY_FILE = "body_file"  # scope["state"] key: the path of a body spooled to a file (its replayed body is then empty)
STOP_CHECK_S = 0.25  # a body being read notices the service shutting down within this long
AHEAD_SHARE = 4  # one client address holds at most 1/AHEAD_SHARE of the budget for body bytes not yet arrived


class BodyLimitMiddleware:
    """Checks ``Content-Length`` up front; a body without one (chunked) is read here first,
    counted as it arrives, and refused with 413 as soon as it passes the limit.

    ``path_limits`` maps a path to its own ``(limit in bytes, config key named in the 413)``
    (file uploads); every other path has ``max_body_bytes`` (``api.max_body_bytes``).

    With ``budget``, the bodies of requests to ``budget_paths`` (the generation endpoints, whose
    images are in their bodies) hold their size in it while they are read and parsed: the
    ``Content-Length`` before a byte is read (a chunked body as it arrives, at most the budget's
    capacity): a body announced by its ``Content-Length`` that does not fit waits for room, first come
    first served, up to ``wait_s`` (``admission.image_wait_s``), then is refused with 429 ``image_bytes``
    and ``Retry-After`` before a byte of it is read, so a burst of large uploads never grows memory past
    the budget; bytes held as they arrive never wait (a body holding part of the budget while it waits
    could be what the calls ahead of it wait for): no room, and it is refused with that 429 at once. The handler hands the reservation back when its own image
    reservation takes over (:func:`release_body`), else it ends with the request. A call to a route
    that takes the ``api_key`` (``/v1/*``, ``/internal/*``) without it gets its 401 here, on its
    headers, before a byte of its body is read or held (a file upload too). A generation body is
    read here, before the route runs: one whose body sends no byte for ``idle_timeout_s``, or is not complete
    ``read_timeout_s`` after arrival, gets 408 ``body_timeout`` and its connection is closed, so
    stalled uploads cannot keep the budget; one still arriving when the service starts shutting
    down (``stopping()`` returns the ``Retry-After`` seconds, None while serving) gets that 503
    within :data:`STOP_CHECK_S`. A client address holds at most 1/:data:`AHEAD_SHARE` of the budget
    for bytes its bodies announced and have not sent (past that, its bodies are held as they
    arrive), so one client cannot keep the budget by announcing large bodies and trickling them
    over fresh connections. Bodies this middleware does not read (file uploads) get the idle
    timeout and the stopping 503 too. Every answer given here closes the connection (its body is
    unread, whatever a client sending ``Expect: 100-continue`` does next). ``on_refused(path, status)`` is
    told of the 401s, 408s, 413s and 503s given here."""

    def __init__(self, app: Any, max_body_bytes: int, path_limits: dict[str, tuple[int, str]] | None = None,
                 budget: ByteBudget | None = None, budget_paths: frozenset[str] = frozenset(),
                 on_refused: Callable[[str, int], None] | None = None, api_keys: tuple[str, ...] = (),
                 idle_timeout_s: float = 10.0, read_timeout_s: float = 60.0,
                 stopping: Callable[[], int | None] = lambda: None, wait_s: float = 10.0,
                 spool_bytes: int = 256 << 10) -> None:
        self.app = app
        self.wait_s = wait_s
        self.spool_bytes = spool_bytes
        self.max_body_bytes = max_body_bytes
        self.path_limits = dict(path_limits or {})
        self.budget = budget
        self.budget_paths = budget_paths
        self.on_refused = on_refused
        self.api_keys = api_keys
        self.idle_timeout_s = idle_timeout_s
        self.read_timeout_s = read_timeout_s
        self.stopping = stopping
        self._ahead = AheadByClient()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        limit, key = self.path_limits.get(path, (self.max_body_bytes, "api.max_body_bytes"))
        length = next((value for name, value in scope.get("headers", []) if name == b"content-length"), None)
        declared = int(length) if length is not None and length.isdigit() else None
        if keyed_path(path) and not scope_authorized(scope.get("headers", []), self.api_keys):
            await self._answer(scope, receive, send, unauthorized())
            return
        if declared is not None and declared > limit:
            await self._answer(scope, receive, send, _too_large(limit, key))
            return
        guarded = path in self.budget_paths
        held = BodyHold(self.budget if guarded else None)
        scope.setdefault("state", {})["release_body"] = held.release
        client = str((scope.get("client") or ("",))[0])
        try:
            if declared is not None and guarded and self.budget is not None:
                held.ahead = self._ahead.take(client, declared, self.budget.capacity // AHEAD_SHARE)
                if not await held.add_waiting(held.ahead, self.wait_s):
                    self._ahead.give(client, held.ahead)
                    held.ahead = 0
                    await self._refuse_busy(scope, receive, send, declared)
                    return
            if not guarded:
                if declared is not None:
                    await self._watched(scope, receive, send)
                    return
                await self._read_first(scope, receive, send, limit, key, held, timed=False)
                return
            await self._read_first(scope, receive, send, limit, key, held, timed=True, client=client)
        finally:
            self._ahead.give(client, held.ahead)  # what had not arrived (the rest went back as it did)
            held.ahead = 0
            held.release()

    async def _read_first(self, scope: Scope, receive: Any, send: Any, limit: int, key: str, held: BodyHold,
                          timed: bool, client: str = "") -> None:
        """Read the whole body, then run the app on it. Its first ``held.ahead`` bytes are held
        already (as they arrive they leave ``client``'s share of bytes held ahead of arrival); each
        byte past them is held as it arrives. ``timed``: within the idle and read timeouts, and
        the stop check. A body past ``spool_bytes`` goes to a :class:`BodySpool` as it arrives (never
        joined in this process): the app then finds its path in ``scope["state"][BODY_FILE]`` and an
        empty body; the file is deleted when the app returns."""
        chunks: list[bytes] = []
        seen = 0
        spool: BodySpool | None = None
        deadline = time.monotonic() + self.read_timeout_s if timed else math.inf
        try:
            while True:
                try:
                    message = await self._timed_receive(receive, deadline)
                except _ServiceStopping as stopping:
                    await self._answer(scope, receive, send, _stopping(stopping.retry_after_s))
                    return
                except asyncio.TimeoutError:
                    await self._answer(scope, receive, send, self._timed_out(seen, timed))
                    return
                if message["type"] != "http.request":  # the client went away
                    return
                chunk = message.get("body", b"")
                seen += len(chunk)
                if seen > limit:
                    await self._answer(scope, receive, send, _too_large(limit, key))
                    return
                covered = min(len(chunk), held.ahead)  # of this chunk, held before it came
                held.ahead -= covered
                self._ahead.give(client, covered)
                if not held.add_now(len(chunk) - covered):  # never waits holding part of a body
                    await self._refuse_busy(scope, receive, send, seen)
                    return
                if spool is None and timed and seen > self.spool_bytes:  # generation bodies only (parsed by BodyParser)
                    spool = BodySpool()  # here: a creation cancelled in a thread would leave its file
                    await asyncio.to_thread(spool.write_all, chunks)
                    chunks.clear()
                if spool is not None:  # a write can wait for the disk (its dirty pages): never on the loop
                    await asyncio.to_thread(spool.write, chunk)
                else:
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            replayed = False
            if spool is not None:
                scope.setdefault("state", {})[BODY_FILE] = spool.path

            async def replay() -> Any:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                return await receive()  # after the body: wait for a disconnect, as the server would

            await self.app(scope, replay, send)
        finally:
            if spool is not None:
                spool.close()

    async def _watched(self, scope: Scope, receive: Any, send: Any) -> None:
        """Run the app on a body it reads itself (a file upload, streamed to disk by its form
        parser): while the body is incomplete, a wait for more of it that lasts
        ``idle_timeout_s`` is answered 408 here, and the service's stop the stopping 503; the
        response is then this middleware's, the app sees a disconnect and what it sends is dropped."""
        taken = False
        done = False
        seen = 0

        async def watched_receive() -> Any:
            nonlocal taken, done, seen
            if taken:
                return {"type": "http.disconnect"}
            if done:
                return await receive()
            try:
                message = await self._timed_receive(receive, math.inf)
            except _ServiceStopping as stopping:
                taken = True
                await self._answer(scope, receive, send, _stopping(stopping.retry_after_s))
                return {"type": "http.disconnect"}
            except asyncio.TimeoutError:
                taken = True
                await self._answer(scope, receive, send, self._timed_out(seen, False))
                return {"type": "http.disconnect"}
            seen += len(message.get("body", b""))
            done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def watched_send(message: Any) -> None:
            if not taken:
                await send(message)

        try:
            await self.app(scope, watched_receive, watched_send)
        except Exception:
            if not taken:  # after this middleware answered, the app's reaction to the "disconnect" is moot
                raise

    def _timed_out(self, seen: int, read_limit: bool) -> APIError:
        """408 ``body_timeout`` for a body of which ``seen`` bytes arrived (``read_limit``: the read
        timeout applied too)."""
        limits = f"none for {self.idle_timeout_s:g} s (api.body_idle_timeout_s)"
        if read_limit:
            limits += f" or the body was not complete {self.read_timeout_s:g} s after the request (api.body_read_timeout_s)"
        return APIError(408, f"the request body was not received in time: {seen} bytes arrived, then {limits}",
                        code="body_timeout")

    async def _timed_receive(self, receive: Any, deadline: float) -> Any:
        """The next body message, awaited in slices of :data:`STOP_CHECK_S` (a slice that ends
        without one drops nothing: uvicorn's ``receive`` only consumes a message it returns).

        Raises:
            asyncio.TimeoutError: none within ``idle_timeout_s``, or ``deadline`` passed.
            _ServiceStopping: the service is shutting down and the body is still awaited (a body
                that is there, such as a GET's empty one, is returned as usual).
        """
        idle_until = min(time.monotonic() + self.idle_timeout_s, deadline)
        while True:
            left = idle_until - time.monotonic()
            if left <= 0:
                raise asyncio.TimeoutError
            try:
                return await asyncio.wait_for(receive(), min(left, STOP_CHECK_S))
            except asyncio.TimeoutError:
                retry_after_s = self.stopping()
                if retry_after_s is not None:
                    raise _ServiceStopping(retry_after_s) from None

    async def _refuse_busy(self, scope: Scope, receive: Any, send: Any, nbytes: int) -> None:
        assert self.budget is not None
        rejection = Rejection(
            429, "image_bytes",
            f"too many request bodies and images are being read and decoded at once: this body needs {nbytes} "
            f"bytes and {self.budget.reserved} of {self.budget.capacity} (admission.max_image_bytes_in_flight) "
            f"are in use after {self.wait_s:g} s of waiting (admission.image_wait_s); retry shortly",
            IMAGE_RETRY_AFTER_S)
        await self._answer(scope, receive, send, from_rejection(rejection))

    async def _answer(self, scope: Scope, receive: Any, send: Any, error: APIError) -> None:
        """Send ``error`` (OpenAI's error format), counted by ``on_refused``, closing the connection:
        its body is unread."""
        if self.on_refused is not None:
            self.on_refused(scope.get("path", ""), error.status)
        response = error_response(error)
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def _too_large(limit: int, key: str) -> APIError:
    return APIError(413, f"request body is larger than the limit of {limit} bytes ({key})", code="request_too_large")


def _stopping(retry_after_s: int) -> APIError:
    return unavailable("the service is shutting down; send the request again later", retry_after_s)


class _ServiceStopping(Exception):
    """The service began shutting down while a body was being read."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"shutting down; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s
