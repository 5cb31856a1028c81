"""The ``--server`` backend: any OpenAI-compatible server (``mm-serve serve``, vLLM, SGLang, ...).

Folder and JSONL inputs become ``POST /v1/chat/completions`` with one user message
(the image as a ``data:`` URI, then the prompt). Images are validated here first
(:func:`~mm_serve.caption.backends.load_item_image`), so a broken image never
reaches the server and its error reads the same on every server. PNG, JPEG, WebP
and GIF files are sent as they are; BMP and TIFF are re-encoded as PNG, since not
every server accepts them. OpenAI batch bodies are sent unchanged (``model``
filled in when absent).

Retries: connection failures and 429/502/503/504 answers are retried
``retries`` times with exponential back-off (0.5 s, 1 s, 2 s, ...). A server that
stays unreachable raises :class:`FatalBackendError`, and so do 401/403 (a bad key)
and, for caption requests, 404 (a wrong model name): they would fail every input
alike. Any other error status becomes that input's error row.
"""

from __future__ import annotations

import asyncio
import base64
import io
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from PIL import Image

from mm_serve.caption.backends import (
    CaptionBackend,
    FatalBackendError,
    load_item_image,
    read_error_message,
)
from mm_serve.caption.inputs import CaptionInput
from mm_serve.caption.records import Outcome, failure
from mm_serve.media.errors import ImageError
from mm_serve.media.local_file import read_media_file
from mm_serve.protocol.batch_rows import answered_whole

RETRY_STATUSES = frozenset({429, 502, 503, 504})
_PASS_THROUGH = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}
_VIDEO_TYPES = {".mp4": "mp4", ".m4v": "mp4", ".webm": "webm", ".mov": "quicktime", ".mkv": "x-matroska",
                ".avi": "x-msvideo"}  # video file suffix -> its MIME subtype
Answer = tuple[int, dict[str, Any], str | None]  # (HTTP status, JSON body, x-request-id header)


class ServerBackend(CaptionBackend):
    """Captions through an OpenAI-compatible HTTP API.

    Args:
        url: the server, with or without the ``/v1`` suffix (``http://127.0.0.1:8000``).
        model: the model name to send; None asks ``GET /v1/models`` for the first one.
        api_key: sent as ``Authorization: Bearer``; None sends no header.
        max_tokens: ``max_tokens`` of caption requests.
        temperature: ``temperature`` of caption requests (0 = greedy).
        max_pixels: the local image-size limit (width x height, px).
        concurrency: connections kept open (the job's in-flight window).
        timeout_s: seconds one request may take before it becomes an error row.
        retries: attempts after the first, for connection failures and 429/5xx.
    """

    name = "server"

    def __init__(self, url: str, *, model: str | None = None, api_key: str | None = None, max_tokens: int = 64,
                 temperature: float = 0.0, max_pixels: int = 40_000_000, concurrency: int = 32,
                 timeout_s: float = 600.0, retries: int = 3) -> None:
        base = url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else f"{base}/v1"
        self.model = model
        self.max_tokens, self.temperature, self.max_pixels = max_tokens, temperature, max_pixels
        self.retries = retries
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, limits=limits,
                                       timeout=httpx.Timeout(timeout_s, connect=10.0))

    @property
    def default_concurrency(self) -> int:
        """32 requests in flight: enough to fill a typical server's decode batch."""
        return 32

    async def start(self) -> None:
        """Check the server answers and pick the model when none was given.

        Raises:
            FatalBackendError: unreachable, a 401/403 (a bad key), or ``/v1/models`` lists no model.
        """
        if self.model is not None:
            return
        status, payload, request_id = await self._send("GET", "/models")
        if status in (401, 403):  # the key, not the model: say so (--served-model would only move the 401)
            error = _outcome(0.0, status, payload, request_id).error
            raise FatalBackendError(f"{self.base_url}/models answered {status} (check the API key: $OPENAI_API_KEY "
                                    f"or --api-key): {error}")
        models = payload.get("data") if status == 200 else None
        if not isinstance(models, list) or not models or not isinstance(models[0], dict):
            raise FatalBackendError(f"{self.base_url}/models answered {status} without a model; pass --served-model")
        self.model = str(models[0].get("id"))

    async def run(self, item: CaptionInput) -> Outcome:
        """Caption one input (see :class:`CaptionBackend` for the contract)."""
        start = time.perf_counter()
        if item.body is not None:
            body = answered_whole(self.model, item.body)
        else:
            try:
                uri = await asyncio.to_thread(self._video_uri if item.is_video else self._image_uri, item)
            except OSError as exc:
                return failure(time.perf_counter() - start, read_error_message(item, exc), "image_unreadable")
            except ImageError as exc:
                return failure(time.perf_counter() - start, str(exc), "invalid_image")
            part = {"type": "video_url", "video_url": {"url": uri}} if item.is_video else {
                "type": "image_url", "image_url": {"url": uri}}
            content = [part, {"type": "text", "text": item.prompt}]
            body = {"model": self.model, "messages": [{"role": "user", "content": content}],
                    "max_tokens": self.max_tokens, "temperature": self.temperature}
        try:
            status, payload, request_id = await self._send("POST", "/chat/completions", body)
        except httpx.TimeoutException as exc:
            return failure(time.perf_counter() - start, f"the request timed out ({type(exc).__name__})", "timeout")
        outcome = _outcome(time.perf_counter() - start, status, payload, request_id)
        if status in (401, 403) or (status == 404 and item.body is None):
            raise FatalBackendError(f"{self.base_url}/chat/completions answered {status}: {outcome.error}")
        return outcome

    @staticmethod
    def _video_uri(item: CaptionInput) -> str:
        """The data URI of a video input (the server decodes and checks it; in a thread)."""
        assert item.image is not None
        if item.image[:5].lower() == "data:":
            return item.image
        data = read_media_file(item.image)
        subtype = _VIDEO_TYPES.get(Path(item.image).suffix.lower(), "mp4")
        return f"data:video/{subtype};base64,{base64.b64encode(data).decode('ascii')}"

    def _image_uri(self, item: CaptionInput) -> str:
        """Validate the image and return the data URI to send (in a thread)."""
        image = load_item_image(item, self.max_pixels)
        if item.image is None or item.image[:5].lower() == "data:":
            return str(item.image)
        data = read_media_file(item.image)
        with Image.open(io.BytesIO(data)) as header:
            fmt = header.format or ""
        if fmt not in _PASS_THROUGH:
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            data, fmt = buffer.getvalue(), "PNG"
        return f"data:image/{_PASS_THROUGH[fmt]};base64,{base64.b64encode(data).decode('ascii')}"

    async def _send(self, method: str, path: str, body: dict[str, Any] | None = None) -> Answer:
        """One request with retries; returns (status, JSON body or ``{}``, request id).

        Raises:
            FatalBackendError: still no connection after the retries.
            httpx.TimeoutException: the server accepted the request but did not answer in time.
        """
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                response = await self._http.request(method, path, json=body)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                if last:
                    raise FatalBackendError(f"cannot reach {self.base_url}: {exc!r}") from None
            else:
                if response.status_code not in RETRY_STATUSES or last:
                    return response.status_code, _json(response), response.headers.get("x-request-id")
            await asyncio.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")  # the loop always returns or raises on its last attempt

    async def aclose(self) -> None:
        """Close the connections. Idempotent."""
        await self._http.aclose()


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        payload = response.json()
    except ValueError:
        return {"error": {"message": f"non-JSON answer: {response.text[:200]!r}", "code": None}}
    return payload if isinstance(payload, dict) else {"value": payload}


def _outcome(latency: float, status: int, payload: dict[str, Any], request_id: str | None) -> Outcome:
    """A success Outcome from a 200 ``chat.completion``, else a failure with the server's message."""
    request_id = request_id or (payload.get("id") if isinstance(payload.get("id"), str) else None)
    if status == 200:
        try:
            text = payload["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            return failure(latency, "the server answered 200 without choices[0].message", "bad_response", 200, payload)
        usage = payload.get("usage") or {}
        return Outcome(latency_s=latency, caption=str(text).strip(), prompt_tokens=usage.get("prompt_tokens"),
                       completion_tokens=usage.get("completion_tokens"), status_code=200, body=payload,
                       request_id=request_id)
    raw_error = payload.get("error")
    error: dict[str, Any] = raw_error if isinstance(raw_error, dict) else {}
    message = str(error.get("message") or f"HTTP {status}")
    code = error.get("code") or error.get("type") or f"http_{status}"
    return replace(failure(latency, message, str(code), status, payload), request_id=request_id)
