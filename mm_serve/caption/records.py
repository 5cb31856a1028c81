"""What one input produced (:class:`Outcome`) and the output row it becomes.

Two row layouts, chosen by the input format:

* caption rows (folder and JSONL inputs), one of::

    {"id", "path", "caption", "prompt_tokens", "completion_tokens", "latency_s"}
    {"id", "path", "error"}

* OpenAI batch output rows (OpenAI batch inputs), one of::

    {"id": "batch_req_...", "custom_id", "response": {"status_code": 200, "request_id", "body": <chat.completion>}, "error": null}
    {"id": "batch_req_...", "custom_id", "response": {"status_code", "request_id", "body": <error body>} | null,
     "error": {"code", "message"}}

A row counts as done for resume when it has no error (:func:`row_succeeded`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from mm_serve.caption.inputs import CaptionInput, InputFormat
from mm_serve.protocol.errors import APIError


@dataclass(frozen=True)
class Outcome:
    """The result of one input, success or failure.

    Attributes:
        latency_s: seconds from the input entering the in-flight window (image
            loading included) until its answer was complete.
        caption: the generated text (stripped) on success.
        prompt_tokens: prompt tokens (image tokens included), when known.
        completion_tokens: generated tokens, when known.
        error: the failure message; None on success.
        error_code: a short machine-readable code (OpenAI ``error.code``) for failures.
        status_code: the HTTP status (real, or what our server would answer) when known.
        body: the response body (a ``chat.completion``, or an error body) when known.
        request_id: the server's or engine's id of the request, when known.
    """

    latency_s: float
    caption: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    error_code: str | None = None
    status_code: int | None = None
    body: dict[str, Any] | None = None
    request_id: str | None = None

    @property
    def ok(self) -> bool:
        """True when the input succeeded."""
        return self.error is None


def failure(latency_s: float, message: str, code: str = "invalid_request", status_code: int | None = None,
            body: dict[str, Any] | None = None) -> Outcome:
    """An :class:`Outcome` for a failed input."""
    return Outcome(latency_s=latency_s, error=message, error_code=code, status_code=status_code, body=body)


def refused(latency_s: float, error: APIError) -> Outcome:
    """A failed input with the status code and OpenAI error body the server sends for ``error``."""
    return failure(latency_s, error.message, error.code or error.type, error.status, error.body())


def answered(latency_s: float, body: dict[str, Any], caption: str | None = None) -> Outcome:
    """A served input: its response ``body`` (a ``chat.completion`` or ``text_completion``)."""
    usage = body.get("usage") or {}
    return Outcome(latency_s=latency_s, caption=caption, prompt_tokens=usage.get("prompt_tokens"),
                   completion_tokens=usage.get("completion_tokens"), status_code=200, body=body,
                   request_id=str(body.get("id")))


def caption_row(item: CaptionInput, outcome: Outcome) -> dict[str, Any]:
    """The caption-format row of ``item``."""
    if not outcome.ok:
        return {"id": item.id, "path": item.path, "error": outcome.error}
    return {
        "id": item.id, "path": item.path, "caption": outcome.caption,
        "prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
        "latency_s": round(outcome.latency_s, 4),
    }


def batch_row(item: CaptionInput, outcome: Outcome) -> dict[str, Any]:
    """The OpenAI batch output row of ``item``."""
    response = None
    if outcome.status_code is not None:
        response = {"status_code": outcome.status_code, "request_id": outcome.request_id or uuid.uuid4().hex,
                    "body": outcome.body}
    error = None if outcome.ok else {"code": outcome.error_code, "message": outcome.error}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item.id, "response": response, "error": error}


def output_row(fmt: InputFormat, item: CaptionInput, outcome: Outcome) -> dict[str, Any]:
    """The row of ``item`` in the layout of input format ``fmt``."""
    return batch_row(item, outcome) if fmt == "openai-batch" else caption_row(item, outcome)


def row_id(fmt: InputFormat, row: dict[str, Any]) -> str | None:
    """The input id a row answers, or None when the row is not of ``fmt``'s layout."""
    if fmt == "openai-batch":
        value = row.get("custom_id")
    else:
        value = None if "custom_id" in row else row.get("id")
    return value if isinstance(value, str) else None


def row_succeeded(row: dict[str, Any]) -> bool:
    """True for a success row of either layout (no error, or ``"error": null``)."""
    return row.get("error") is None
