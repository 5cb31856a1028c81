"""OpenAI-format errors (``{"error": {"message", "type", "param", "code"}}``).

Status codes: 400 bad input, 401 missing/wrong key, 404 unknown model or path,
413 body too large, 429 refused by admission control (a queue cap or a predicted SLO
miss; with ``Retry-After``), 503 the service cannot take the request now. A failure is
never a 200 with error text, and never an unformatted 500.
"""

from __future__ import annotations

import functools
from typing import Any

from fastapi.exceptions import RequestValidationError

from mm_serve.protocol.schemas import ErrorDetail, ErrorResponse


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
        self.counted = False  # its call's engine requests were counted as they finished (mm_serve_requests_total)

    def body(self) -> dict[str, Any]:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param,
                                               code=self.code)).model_dump()

    def response_headers(self) -> dict[str, str]:
        """The headers to send with it (``Retry-After``; ``WWW-Authenticate`` on a 401)."""
        return {"WWW-Authenticate": "Bearer", **self.headers} if self.status == 401 else dict(self.headers)


STOPPED_MESSAGE = "the service stopped before this request was answered; send it again"
STOPPED_RETRY_AFTER_S = 1  # the Retry-After of that 503: a replacement may answer soon

def counted(error: APIError) -> APIError:
    """``error``, marked as the answer of a call whose engine requests the metrics counted as they finished
    (so the error handler does not count the call again)."""
    error.counted = True
    return error


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400 ``invalid_request_error`` naming ``param`` (and OpenAI's ``code`` when given)."""
    return APIError(400, message, "invalid_request_error", param, code)


def retry_after(seconds: int | None) -> dict[str, str]:
    """The ``Retry-After`` header (whole seconds), or none."""
    return {} if seconds is None else {"Retry-After": str(seconds)}


def unavailable(message: str, retry_after_s: int | None = None) -> APIError:
    """503 ``service_unavailable``, with ``Retry-After`` (whole seconds) when a retry can be timed."""
    return APIError(503, message, "service_unavailable", None, "service_unavailable", retry_after(retry_after_s))


def validation_error(exc: RequestValidationError) -> APIError:
    """The 400 that the API answers for a body failing its schema (same message, ``param`` and ``code``)."""
    return bad_request(*_validation_message(exc))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str | None]:
    """The message, ``param`` and ``code`` of a schema failure's 400."""
    errors: list[Any] = list(exc.errors())
    if not errors:
        return "invalid request", None, None
    # For a union such as ``content: str | list[part]``, report the most specific branch
    # (the part's own error), not "should be a valid string".
    # A whole-model validator's error has an empty ``loc`` (FastAPI prefixes "body"; a direct
    # ``model_validate``, as a batch row's, does not).
    specific = [e for e in errors if "str" not in map(str, e.get("loc", ()))]
    first = max(specific or errors, key=lambda e: len(e.get("loc", ())))
    loc = _json_path(first)
    message = str(first.get("msg", "invalid value"))
    # a value of none of a union's types (``"content": 5``): name every branch, not the last one tried
    wrong_type = [str(e.get("msg")) for e in errors if str(e.get("type", "")).endswith("_type") and _json_path(e) == loc]
    if len(wrong_type) > 1 and str(first.get("type", "")).endswith("_type"):
        kinds = list(dict.fromkeys(m.removeprefix("Input should be ") for m in wrong_type))
        message = "Input should be " + " or ".join(kinds)
    if first.get("type") == "json_invalid":  # loc ("body", character offset); ctx the parser's reason
        reason = first.get("ctx", {}).get("error") or first.get("msg")
        where = first.get("loc", ())[-1:]
        at = f" at character {where[0]}" if where and isinstance(where[0], int) else ""
        return f"request body is not valid JSON: {reason}{at}", None, None
    if first.get("type") in ("unsupported_parameter", "invalid_parameter"):
        ctx = first.get("ctx", {})
        return str(first.get("msg")), str(ctx.get("name")) or None, ctx.get("code")
    if first.get("type") == "missing" and not loc:
        return "request body is missing: send a JSON object", None, None
    param = ".".join(loc) or None
    where = f" at '{param}'" if param else ""
    return f"{message}{where}", param, None


def _json_path(error: Any) -> list[str]:
    """A schema error's location as the JSON's path: without pydantic's branch labels
    ("list[tagged-union[...]]", "str", a union member's model name: ``NamedToolChoice``) and the
    ``body`` root."""
    models = _model_names()
    loc = [str(p) for p in error.get("loc", ())
           if p != "body" and "[" not in str(p) and p != "str" and not (isinstance(p, str) and p in models)]
    return [p for i, p in enumerate(loc) if i == 0 or p != loc[i - 1]]


@functools.lru_cache(maxsize=1)
def _model_names() -> frozenset[str]:
    """The class names of the request models (pydantic's labels of union members in an error's location)."""
    from pydantic import BaseModel

    names, todo = set(), list(BaseModel.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("mm_serve."):
            names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return frozenset(names)
