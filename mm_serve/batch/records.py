"""The stored record of an uploaded file and of a batch, and their OpenAI object shapes.

Ids are random (128 bits from :mod:`secrets`), so one client cannot reach another's
file or batch by guessing: ``file-<32 hex>``, ``batch_<32 hex>``. Each record also keeps its
owner, the fingerprint of the API key that made it (:func:`owner_of`): with ``api.api_key``
a list of keys (one per tenant), a key lists and reads only its own files and batches.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any, Literal

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired",
                      "cancelling", "cancelled"]
ACTIVE_STATUSES: tuple[BatchStatus, ...] = ("validating", "in_progress", "finalizing", "cancelling")
"""Statuses of a batch that is not finished yet (a restarted server resumes these)."""
FINISHED_STATUSES: tuple[BatchStatus, ...] = ("failed", "completed", "expired", "cancelled")


def new_file_id() -> str:
    """A fresh, unguessable file id (``file-`` + 32 hex digits)."""
    return f"file-{secrets.token_hex(16)}"


def new_batch_id() -> str:
    """A fresh, unguessable batch id (``batch_`` + 32 hex digits)."""
    return f"batch_{secrets.token_hex(16)}"


def owner_of(api_key: str | None) -> str:
    """The owner a call's files and batches are stored under: the first 32 hex digits of the SHA-256 of
    the API key it came with (the key itself is never stored), or "" for a call without one (a server
    with no ``api.api_key``)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32] if api_key else ""


@dataclass(frozen=True)
class FileRecord:
    """An uploaded (``purpose="batch"``) or produced (``"batch_output"``) file.

    Attributes:
        id: the file id.
        purpose: ``batch`` for uploads, ``batch_output`` for output and error files.
        filename: the name the client gave (uploads) or ``batch_..._output.jsonl``.
        bytes: the content's size in bytes.
        created_at: Unix time (s) of the upload.
        owner: :func:`owner_of` the key that uploaded it (output files: the batch's); "" for none.
    """

    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: int
    owner: str = ""

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``file`` object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "status_details": None, "expires_at": None}


@dataclass
class BatchRecord:
    """A batch as stored; timestamps are Unix seconds, None until reached.

    ``completed`` and ``failed`` count rows with a success and an error row in the
    results so far (``request_counts``); ``total`` is the number of rows. ``owner`` is
    :func:`owner_of` the key that created it ("" for none).
    """

    id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    status: BatchStatus
    created_at: int
    expires_at: int
    model: str | None = None
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    owner: str = ""

    @property
    def finished(self) -> bool:
        """True once the batch reached a final status."""
        return self.status in FINISHED_STATUSES

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``batch`` object."""
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint, "model": self.model,
            "errors": None if self.errors is None else {"object": "list", "data": self.errors},
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": self.created_at, "in_progress_at": self.in_progress_at, "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at, "completed_at": self.completed_at, "failed_at": self.failed_at,
            "expired_at": self.expired_at, "cancelling_at": self.cancelling_at, "cancelled_at": self.cancelled_at,
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "metadata": self.metadata,
        }
