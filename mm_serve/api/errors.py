"""OpenAI-format errors (``{"error": {"message", "type", "param", "code"}}``) and their handlers.

Status codes: 400 bad input, 401 missing/wrong key, 404 unknown model or path,
413 body too large, 429 refused by admission control (a queue cap or a predicted SLO
miss; with ``Retry-After``), 503 the service cannot take the request now. A failure is
never a 200 with error text, and never an unformatted 500.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mm_serve.admission.rejection import Rejection
from mm_serve.api.schemas import ErrorDetail, ErrorResponse


class APIError(Exception):
    """An error to send to the client with ``status`` and OpenAI ``type``/``param``/``code``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        # a lone UTF-16 surrogate echoed from the request (e.g. a model name) cannot be
        # encoded as UTF-8: escape it so the error itself can always be sent
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code))
        headers = {"WWW-Authenticate": "Bearer", **self.headers} if self.status == 401 else self.headers
        return JSONResponse(body.model_dump(), status_code=self.status, headers=headers or None)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def _retry_after(seconds: int | None) -> dict[str, str]:
    """The ``Retry-After`` header (whole seconds), or none."""
    return {} if seconds is None else {"Retry-After": str(seconds)}


def unavailable(message: str, retry_after_s: int | None = None) -> APIError:
    """503 ``service_unavailable``, with ``Retry-After`` (whole seconds) when a retry can be timed."""
    return APIError(503, message, "service_unavailable", None, "service_unavailable", _retry_after(retry_after_s))


def validation_error(exc: RequestValidationError) -> APIError:
    """The 400 that the API answers for a body failing its schema (same message, ``param`` and ``code``)."""
    return bad_request(*_validation_message(exc))


def from_rejection(rejection: Rejection) -> APIError:
    """The OpenAI error of an admission refusal: 400 ``invalid_request_error``, 429
    ``rate_limit_error`` or 503 ``service_unavailable``, ``code`` the reason, ``Retry-After``
    in whole seconds when the refusal gives one."""
    kind = {400: "invalid_request_error", 429: "rate_limit_error"}.get(rejection.status, "service_unavailable")
    return APIError(rejection.status, rejection.message, kind, rejection.param, rejection.reason,
                    _retry_after(rejection.retry_after_s))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str | None]:
    """The message, ``param`` and ``code`` of a schema failure's 400."""
    errors: list[Any] = list(exc.errors())
    if not errors:
        return "invalid request", None, None
    # For a union such as ``content: str | list[part]``, report the most specific branch
    # (the part's own error), not "should be a valid string".
    specific = [e for e in errors if str(e.get("loc", ("",))[-1]) not in ("str",) and "str" not in map(str, e.get("loc", ()))]
    first = max(specific or errors, key=lambda e: len(e.get("loc", ())))
    # Drop pydantic's branch labels ("list[tagged-union[...]]", "str") so the path reads like the JSON.
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and "[" not in str(p) and p != "str"]
    loc = [p for i, p in enumerate(loc) if i == 0 or p != loc[i - 1]]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg')}", None, None
    if first.get("type") in ("unsupported_parameter", "invalid_parameter"):
        ctx = first.get("ctx", {})
        return str(first.get("msg")), str(ctx.get("name")) or None, ctx.get("code")
    if first.get("type") == "missing" and not loc:
        return "request body is missing: send a JSON object", None, None
    param = ".".join(loc) or None
    where = f" at '{param}'" if param else ""
    return f"{first.get('msg', 'invalid value')}{where}", param, None


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None] | None = None) -> None:
    """Map validation errors to 400 and every error to OpenAI's error JSON; ``on_error(status)`` counts them."""

    def respond(error: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(error.status)
        return error.response()

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(Rejection)
    async def _rejection(_: Request, exc: Rejection) -> JSONResponse:
        return respond(from_rejection(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return respond(APIError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return respond(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_server_error"))
