"""Request bodies parsed and validated without stalling the event loop.

Decoding JSON (``json.loads``) and validating it (pydantic-core) are C and Rust calls that hold the GIL
for their whole run: a worker *thread* would stall the loop just the same (a 61 MB body of 4,096 text
parts, the largest the default limits allow, takes 0.2 s to decode and 0.5 s to validate; 2.3 million
one-letter parts, refused only once counted, 0.8 s and 6 s). So a body over :data:`INLINE_PARSE_BYTES`
is decoded, validated and checked against the per-request limits (``api.max_messages`` ...) in a parse
process, from the file the body middleware spooled it to as it arrived (the API process never joins or
copies it: one 61 MB copy holds the GIL for ~30 ms on a 2-core machine) (a ``ProcessPoolExecutor`` of one spawned process, started on the first large body); what comes
back is the validated request, whose pickle the pool's own result thread reads (a bounded object count,
since it passed the limits), or the error. A small body is parsed on the loop, where it costs less than
the hand-off (256 KiB: a few ms at worst). One API process per port stays (vLLM's ``--api-server-count``
would share a port between processes, but a poll of ``/health`` can land on the busy one).

Both paths follow FastAPI's body handling: a body is JSON when its ``Content-Type`` is
``application/json`` or ``application/*+json`` (none or another: refused, FastAPI's strict content type),
and every error is the 400 :func:`~mm_serve.protocol.errors.validation_error` makes of FastAPI's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import email.message
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from mm_serve.cluster.stale_instances import name_own_semaphores
from mm_serve.config import APIConfig
from mm_serve.ground.json_text import JSONTextError, load_json
from mm_serve.pipeline.call import check_limits
from mm_serve.protocol.errors import APIError, bad_request, validation_error

INLINE_PARSE_BYTES = 256 << 10
PARENT_CHECK_S = 0.5  # how often the parse process checks that the API process is alive
# Seconds a body may take in the parse process (the worst the default limits allow is ~7 s on a 2-core CPU,
# see above); past it the process is taken for hung (stopped, swapped out), killed and started again.
PARSE_TIMEOUT_S = 30.0
M = TypeVar("M", bound=BaseModel)


def is_json(content_type: str | None) -> bool:
    """Whether a ``Content-Type`` value names JSON (``application/json``, ``application/*+json``)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def parse_body(body: bytes, content_type: str | None, model: type[M], api: APIConfig | None = None) -> M:
    """``body`` decoded and validated as ``model``; with ``api``, also within its per-request limits
    (:func:`~mm_serve.pipeline.call.check_limits`).

    Raises:
        APIError: 400 for a body that is not JSON, fails the schema, or passes a limit (the same message,
            ``param`` and ``code`` FastAPI's own parsing led to).
    """
    if body and not is_json(content_type):
        raise bad_request("send the request body as JSON with 'Content-Type: application/json'")
    try:
        data = load_json(body) if body else None
    except JSONTextError as exc:
        if exc.pos is None:  # nested too deeply, an integer past 4,300 digits, bytes in no UTF encoding
            raise bad_request(f"request body is not valid JSON: {exc.reason}") from None
        raise validation_error(RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos),
                                                        "msg": "JSON decode error", "input": {},
                                                        "ctx": {"error": exc.reason}}])) from None
    if data is None:
        raise validation_error(RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required",
                                                        "input": None}]))
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors()]
        raise validation_error(RequestValidationError(errors)) from None
    if api is not None:
        check_limits(parsed, api)  # type: ignore[arg-type]
    return parsed


def _parse_in_process(source: bytes | str, content_type: str | None, model: type[M],
                      api: APIConfig) -> tuple[str, Any]:
    """:func:`parse_body` in the parse process on a body or the path of the file it was spooled to:
    ("ok", the request) or ("error", the error's fields) (an exception with its own constructor does not
    pickle back by itself)."""
    try:
        body = Path(source).read_bytes() if isinstance(source, str) else source
        return "ok", parse_body(body, content_type, model, api)
    except APIError as exc:
        return "error", (exc.status, exc.message, exc.type, exc.param, exc.code)
    except Exception as exc:  # noqa: BLE001 - anything else a body can make the parser raise is the body's fault
        return "error", (400, f"request body could not be parsed: {type(exc).__name__}: {str(exc)[:200]}",
                         "invalid_request_error", None, None)


def _init_parse_process(parent: int) -> None:
    """The parse process's initializer: a thread that ends the process once the API process ``parent`` is gone
    (SIGKILLed, its shutdown never ran; the pool's pipes alone do not wake an idle worker). It ignores SIGINT:
    Ctrl-C reaches the terminal's whole process group, and the API process stops this one in its own
    shutdown (it printed a KeyboardInterrupt traceback at every Ctrl-C)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="mm-serve-parent-watch", daemon=True).start()


class BodyParser:
    """Parses request bodies for the routes: inline up to ``inline_bytes``, else in the parse process
    (see the module). :meth:`close` stops the process."""

    def __init__(self, api: APIConfig, inline_bytes: int = INLINE_PARSE_BYTES) -> None:
        self.api = api
        self.inline_bytes = inline_bytes
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    async def parse(self, body: bytes, content_type: str | None, model: type[M], body_file: str | None = None,
                    content_encoding: str | None = None) -> M:
        """``body`` as ``model`` within the per-request limits; ``body_file``: the body was spooled to this
        file instead (:class:`~mm_serve.api.body_spool.BodySpool`), which the parse process reads.

        Raises:
            APIError: 415 for a ``Content-Encoding`` other than ``identity`` (bodies are not decompressed:
                a small gzip body could expand past ``api.max_body_bytes``); 400 as :func:`parse_body`; 503
                when the parse process died on this body twice (found dead once, e.g. killed while idle, it
                is started again and the body parsed there), or did not answer within :data:`PARSE_TIMEOUT_S`
                (it is killed and started again).
        """
        if content_encoding and content_encoding.strip().lower() != "identity":
            raise APIError(415, f"request bodies are not decompressed: send it without Content-Encoding "
                                f"(got {content_encoding[:50]!r})", code="unsupported_content_encoding")
        if body_file is None and len(body) <= self.inline_bytes:
            return parse_body(body, content_type, model, self.api)
        source: bytes | str = body if body_file is None else body_file
        for attempt in range(2):  # a parse process found dead (killed while idle) is started again once
            pool = self._pool
            if pool is None:  # (re)started in a thread: a fork is no work for the event loop
                pool = await asyncio.to_thread(self.start)
            try:
                kind, value = await asyncio.wait_for(asyncio.wrap_future(
                    pool.submit(_parse_in_process, source, content_type, model, self.api)), PARSE_TIMEOUT_S)
                break
            except TimeoutError:
                self._drop(pool, kill=True)
                raise APIError(503, f"the request body was not parsed within {PARSE_TIMEOUT_S:g} s (the parse process "
                               "did not answer; it is started again); send it again", "service_unavailable",
                               code="service_unavailable", headers={"Retry-After": "1"}) from None
            except concurrent.futures.process.BrokenProcessPool:
                self._drop(pool)
                if attempt:  # it died on this body twice
                    raise APIError(503, "the request body could not be parsed (the parse process stopped); send "
                                   "it again", "service_unavailable", code="service_unavailable",
                                   headers={"Retry-After": "1"}) from None
        if kind == "error":
            raise APIError(*value)
        return value  # type: ignore[no-any-return]

    def start(self) -> concurrent.futures.ProcessPoolExecutor:
        """The parse process's pool, started (its process spawned and its imports done) if it was not: the
        app calls it once at start, in a thread, so that no request waits for a process to be forked."""
        with self._lock:
            if self._pool is None:
                name_own_semaphores()  # the pool's queues' semaphores: removed by the next start if SIGKILLed
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_init_parse_process,
                    initargs=(os.getpid(),))
                self._pool.submit(is_json, "application/json").result()  # spawned, and this module imported
            return self._pool

    def _drop(self, pool: concurrent.futures.ProcessPoolExecutor, kill: bool = False) -> None:
        """Stop using ``pool`` (the next large body starts another); ``kill``: its process hangs, SIGKILL it
        (a stopped process too) so that its shutdown does not wait for it."""
        with self._lock:
            if self._pool is pool:
                self._pool = None
        if kill:
            for process in list(getattr(pool, "_processes", {}).values()):  # the executor keeps no public handle
                process.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the parse process (waiting for it to exit), if one was started."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
