""":class:`ServerBackend`'s start against answers a server may give (an httpx mock transport in place of the
server: what is checked is how the client words each)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from mm_serve.caption.backends import FatalBackendError
from mm_serve.caption.server_backend import ServerBackend


async def _start(backend: ServerBackend) -> None:
    try:
        await backend.start()
    finally:
        await backend._http.aclose()


def _backend(status: int, body: dict) -> ServerBackend:
    backend = ServerBackend("http://127.0.0.1:9", retries=0)
    backend._http = httpx.AsyncClient(base_url=backend.base_url,
                                      transport=httpx.MockTransport(lambda _: httpx.Response(status, json=body)))
    return backend


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_key_is_named_as_the_cause(status: int) -> None:
    backend = _backend(status, {"error": {"message": "Invalid API key", "type": "authentication_error"}})
    with pytest.raises(FatalBackendError, match=f"answered {status} \\(check the API key.*Invalid API key"):
        asyncio.run(_start(backend))


def test_a_server_without_models_asks_for_served_model() -> None:
    with pytest.raises(FatalBackendError, match="answered 200 without a model; pass --served-model"):
        asyncio.run(_start(_backend(200, {"object": "list", "data": []})))
