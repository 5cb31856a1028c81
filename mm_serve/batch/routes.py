"""The OpenAI Batch API routes: ``/v1/files`` and ``/v1/batches`` (behind ``--api-key`` like ``/v1/*``).

The work is in :class:`mm_serve.batch.service.BatchService`; these handlers only
map HTTP to it, with the calling key's owner (:func:`mm_serve.batch.records.owner_of`): each key
of ``api.api_key`` sees only its own files and batches. Every error is OpenAI's error JSON
(:mod:`mm_serve.protocol.errors`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import FastAPI, File, Form, Query, Request, UploadFile
from fastapi.params import Depends
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field

from mm_serve.api.api_key import call_api_key
from mm_serve.batch.records import owner_of
from mm_serve.batch.service import BatchService
from mm_serve.pipeline.context import ServerContext

UPLOAD_OVERHEAD_BYTES = 1 << 20
"""What a multipart upload may add to ``batch.max_file_bytes`` (boundaries, part headers, the purpose)."""


def call_owner(request: Request) -> str:
    """The owner (:func:`owner_of`) of the key a call came with, as the key check recorded it; "" on a
    server without keys.

    Raises:
        RuntimeError: keys are configured but none was recorded (a route registered without the key
            check): a 500 rather than a call that sees every key's records.
    """
    key = call_api_key(request)
    if key is None and request.app.state.api_keys:
        raise RuntimeError("a Batch API route ran without the API key check")
    return owner_of(key)


Owner = Annotated[str, Depends(call_owner)]  # a route parameter: the calling key's owner


class BatchCreateRequest(BaseModel):
    """``POST /v1/batches``; other OpenAI fields (``output_expires_after``) are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    endpoint: str
    completion_window: str = Field(description="'24h': rows not done by then (batch.completion_window_s) expire")
    metadata: dict[str, str] | None = None


def add_batch_routes(app: FastAPI, service: BatchService, auth: list[Depends]) -> None:
    """Register the files and batches routes of ``service`` on ``app``, each with ``auth``."""

    @app.post("/v1/files", dependencies=auth, summary="Upload a batch input file (multipart: file, purpose=batch)")
    async def upload_file(owner: Owner, file: UploadFile = File(...), purpose: str = Form(...)) -> dict[str, Any]:
        try:
            return await service.upload(file.file, file.filename, purpose, owner)
        finally:
            await file.close()

    @app.get("/v1/files", dependencies=auth, summary="List files")
    async def list_files(owner: Owner, purpose: str | None = None, after: str | None = None,
                         limit: int = Query(10_000, ge=1, le=10_000),
                         order: Literal["asc", "desc"] = "desc") -> dict[str, Any]:
        return service.list_files(purpose, after, limit, order, owner)

    @app.get("/v1/files/{file_id}", dependencies=auth, summary="A file object")
    async def get_file(file_id: str, owner: Owner) -> dict[str, Any]:
        return service.file(file_id, owner).to_openai()

    @app.get("/v1/files/{file_id}/content", dependencies=auth, summary="A file's content (JSON lines)")
    async def file_content(file_id: str, owner: Owner) -> FileResponse:
        return FileResponse(service.file_path(file_id, owner), media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}", dependencies=auth, summary="Delete a file")
    async def delete_file(file_id: str, owner: Owner) -> dict[str, Any]:
        return service.delete_file(file_id, owner)

    @app.post("/v1/batches", dependencies=auth, summary="Create a batch from an uploaded input file")
    async def create_batch(body: BatchCreateRequest, owner: Owner) -> dict[str, Any]:
        return await service.create_batch(body.input_file_id, body.endpoint, body.completion_window, body.metadata,
                                          owner)

    @app.get("/v1/batches", dependencies=auth, summary="List batches, newest first")
    async def list_batches(owner: Owner, after: str | None = None,
                           limit: int = Query(20, ge=1, le=100)) -> dict[str, Any]:
        return service.list_batches(after, limit, owner)

    @app.get("/v1/batches/{batch_id}", dependencies=auth, summary="A batch object")
    async def get_batch(batch_id: str, owner: Owner) -> dict[str, Any]:
        return service.batch(batch_id, owner)

    @app.post("/v1/batches/{batch_id}/cancel", dependencies=auth, summary="Cancel a batch")
    async def cancel_batch(batch_id: str, owner: Owner) -> dict[str, Any]:
        return service.cancel(batch_id, owner)


class BatchAPI:
    """The Batch API as an extension of the app (:class:`mm_serve.api.app.AppExtension`): its routes,
    the upload limit, and its batches started and closed with the app."""

    def __init__(self, ctx: ServerContext) -> None:
        self.service = BatchService(ctx)
        self.max_upload_bytes = ctx.config.batch.max_file_bytes + UPLOAD_OVERHEAD_BYTES

    def body_limits(self) -> dict[str, tuple[int, str]]:
        """Uploads to ``/v1/files`` may be ``batch.max_file_bytes`` plus the form's own bytes."""
        return {"/v1/files": (self.max_upload_bytes, "batch.max_file_bytes, plus 1 MiB of form")}

    def add_routes(self, app: FastAPI, auth: list[Depends]) -> None:
        """The files and batches routes (:func:`add_batch_routes`)."""
        add_batch_routes(app, self.service, auth)

    def start(self) -> None:
        """Resume the unfinished batches of an existing data directory."""
        self.service.start()

    async def close(self) -> None:
        """Stop running batches (they resume at the next start)."""
        await self.service.close()
