"""Server-sent events framing for streamed completions."""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> str:
    """One ``data:`` event with a compact JSON payload."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_event(message: str, type_: str = "service_unavailable", code: str | None = None) -> str:
    """An OpenAI-style error object sent inside a stream (headers are already out); ``code``
    defaults to ``type_``, as the same failure's non-streamed 503 body has it."""
    return event({"error": {"message": message, "type": type_, "param": None, "code": code or type_}})
