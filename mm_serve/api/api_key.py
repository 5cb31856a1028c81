"""The bearer-token check of ``api.api_key`` (``--api-key``), shared by the routes' dependency and
the body middleware, which must refuse a call before its body holds any of the image budget."""

from __future__ import annotations

import hmac
from typing import Any

from mm_serve.protocol.errors import APIError


def matching_key(authorizations: list[str], keys: tuple[str, ...]) -> str | None:
    """The key of ``keys`` that a request's ``Authorization`` header values carry as ``Bearer <key>``, or
    None; None too unless there is exactly one such header: a proxy that reads another of several could
    disagree on whose call it is. Every key is compared, each in constant time, so the time taken tells
    nothing of which matched."""
    if len(authorizations) != 1:
        return None
    authorization = authorizations[0]
    token = (authorization[7:] if authorization.lower().startswith("bearer ") else "").encode()
    found = None
    for key in keys:
        if hmac.compare_digest(token, key.encode()):
            found = key
    return found


def api_key_ok(authorizations: list[str], keys: tuple[str, ...]) -> bool:
    """Whether a request's ``Authorization`` header values carry one of ``keys`` (:func:`matching_key`);
    always True when there are none."""
    return not keys or matching_key(authorizations, keys) is not None


def scope_authorized(headers: list[tuple[bytes, bytes]], keys: tuple[str, ...]) -> bool:
    """:func:`api_key_ok` on the ``Authorization`` headers of raw ASGI ``headers`` (latin-1, as HTTP
    sends them)."""
    return api_key_ok([v.decode("latin-1") for name, v in headers if name == b"authorization"], keys)


KEYED_PREFIXES = ("/v1/", "/internal/")  # the routes that take api.api_key; /health, /metrics, /version, /docs do not


def keyed_path(path: str) -> bool:
    """Whether a request to ``path`` needs the key (checked on its headers before its body is read)."""
    return path.startswith(KEYED_PREFIXES)


def unauthorized() -> APIError:
    """The 401 for a missing or wrong key (``WWW-Authenticate: Bearer`` comes with it)."""
    return APIError(401, "missing or incorrect API key (send 'Authorization: Bearer <key>')",
                    "authentication_error", None, "invalid_api_key")


def call_api_key(request: Any) -> str | None:
    """The key of ``api.api_key`` a request came with, as the routes' key check recorded it on
    ``request.state``; None on a server without keys."""
    return getattr(request.state, "api_key", None)
