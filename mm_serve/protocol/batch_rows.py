"""A Batch API row's request body as it is answered: whole, never streamed."""

from __future__ import annotations

from typing import Any


def answered_whole(model: str | None, body: dict[str, Any] | None) -> dict[str, Any]:
    """``body`` (one row's: a chat or completion request) with ``model`` unless it names one, ``stream``
    off and ``stream_options`` dropped with it: a row's answer is one JSON body in the output file, as in
    OpenAI's Batch API, whichever way the row is run (the server's Batch API, ``mm-serve caption`` in
    process or against a server)."""
    out: dict[str, Any] = {"model": model, **(body or {}), "stream": False}
    out.pop("stream_options", None)
    return out
