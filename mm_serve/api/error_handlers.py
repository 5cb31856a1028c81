"""The app's exception handlers: every error leaves as OpenAI's error JSON.

Status codes: 400 bad input, 401 missing/wrong key, 404 unknown model or path,
413 body too large, 429 refused by admission control (a queue cap or a predicted SLO
miss; with ``Retry-After``), 503 the service cannot take the request now. A failure is
never a 200 with error text, and never an unformatted 500.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mm_serve.admission.rejection import Rejection
from mm_serve.pipeline.refusal import from_rejection
from mm_serve.protocol.errors import APIError, validation_error


def error_response(error: APIError) -> JSONResponse:
    """``error`` as a JSON response with its status and headers."""
    return JSONResponse(error.body(), status_code=error.status, headers=error.response_headers() or None)


def install_error_handlers(app: FastAPI, on_error: Callable[[str, int], None] | None = None) -> None:
    """Map validation errors to 400 and every error to OpenAI's error JSON; ``on_error(path, status)`` is told of
    each (not of those whose call's engine requests were counted as they finished: :attr:`APIError.counted`)."""

    def respond(request: Request, error: APIError) -> JSONResponse:
        if on_error is not None and not error.counted:
            on_error(request.url.path, error.status)
        return error_response(error)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(Rejection)
    async def _rejection(request: Request, exc: Rejection) -> JSONResponse:
        return respond(request, from_rejection(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404 and exc.detail == "Not Found":  # no such route (a handler's 404 says more)
            served = sorted({path for route in app.routes if (path := getattr(route, "path", "")).startswith("/v1/")
                             and "{" not in path})
            return respond(request, APIError(404, f"Invalid URL ({request.method} {request.url.path}): this server serves "
                                         f"{', '.join(served)}", "not_found_error", code="unknown_url"))
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return respond(request, APIError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_server_error"))
