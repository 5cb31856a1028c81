"""Server-sent events framing for streamed completions, and the headers of a stream."""

from __future__ import annotations

import json
from typing import Any

from mm_serve.admission.predictor import Prediction
from mm_serve.engine.request_state import RequestState

DONE = "data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> str:
    """One ``data:`` event with a compact JSON payload."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_event(message: str, type_: str = "service_unavailable", code: str | None = None) -> str:
    """An OpenAI-style error object sent inside a stream (headers are already out); ``code``
    defaults to ``type_``, as the same failure's non-streamed 503 body has it."""
    return event({"error": {"message": message, "type": type_, "param": None, "code": code or type_}})


def failure_event(state: RequestState) -> str:
    """The error event of a stream whose request failed: ``invalid_request_error`` (code ``invalid_grammar``)
    where what it asked cannot be done (:attr:`RequestState.invalid_input`: a non-streamed call's 400), else
    ``service_unavailable`` (a non-streamed call's 503)."""
    if state.invalid_input:
        return error_event(str(state.failure_message), "invalid_request_error", "invalid_grammar")
    return error_event(str(state.failure_message))


PREDICTION_HEADER = "x-mm-serve-predicted-ttft-ms"
TPOT_PREDICTION_HEADER = "x-mm-serve-predicted-tpot-ms"


def prediction_header(prediction: Prediction | None) -> dict[str, str]:
    """The predicted TTFT and TPOT in milliseconds, for a stream's response headers (none without
    a prediction)."""
    if prediction is None:
        return {}
    return {PREDICTION_HEADER: f"{1000 * prediction.ttft_s:.1f}", TPOT_PREDICTION_HEADER: f"{1000 * prediction.tpot_s:.2f}"}
