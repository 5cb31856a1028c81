"""The outermost middleware answers a call whose task is cancelled (the service stopped at once)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from mm_serve.api.cancelled_answer import CancelledAnswerMiddleware
from mm_serve.protocol.errors import STOPPED_MESSAGE

SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}


def _run_cancelled(app: Any) -> list[dict[str, Any]]:
    """Run ``app`` behind the middleware, cancel its task once it waits, return what it sent."""
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # no disconnect ever comes
        return {}

    async def main() -> None:
        task = asyncio.ensure_future(CancelledAnswerMiddleware(app)(dict(SCOPE), receive, send))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    return sent


def test_a_stream_cut_by_the_stop_ends_with_an_error_event_then_done() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        await send({"type": "http.response.body", "body": b'data: {"choices":[]}\n\n', "more_body": True})
        await asyncio.Event().wait()  # decoding when the stop comes

    sent = _run_cancelled(app)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    last = sent[-1]
    assert last["more_body"] is False
    events = last["body"].decode().split("\n\n")
    error = json.loads(events[0].removeprefix("data: "))["error"]
    assert error == {"message": STOPPED_MESSAGE, "type": "service_unavailable", "param": None,
                     "code": "service_unavailable"}
    assert events[1:] == ["data: [DONE]", ""]


def test_a_call_not_yet_answered_gets_a_json_503() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await asyncio.Event().wait()

    sent = _run_cancelled(app)
    start, body = sent[0], sent[-1]
    headers = dict(start["headers"])
    assert start["status"] == 503 and headers[b"retry-after"] == b"1" and headers[b"connection"] == b"close"
    assert json.loads(body["body"])["error"]["code"] == "service_unavailable"


def test_a_finished_stream_or_a_json_response_already_started_is_not_answered_again() -> None:
    async def json_app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{", "more_body": True})
        await asyncio.Event().wait()

    async def ended_stream(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        await asyncio.Event().wait()  # e.g. the background tasks after the response

    assert [m.get("body") for m in _run_cancelled(json_app)] == [None, b"{"]
    assert [m.get("body") for m in _run_cancelled(ended_stream)] == [None, b"data: [DONE]\n\n"]


def test_a_client_that_does_not_read_is_dropped_after_the_last_words_wait() -> None:
    """Its socket buffers full, the last event would wait forever and keep the process from exiting: it gets
    LAST_WORDS_S seconds, then the call ends quietly."""
    from mm_serve.api import cancelled_answer

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        await asyncio.Event().wait()

    async def main() -> float:
        started = asyncio.Event()

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                started.set()
                return
            await asyncio.Event().wait()  # never drained

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()
            return {}

        task = asyncio.ensure_future(CancelledAnswerMiddleware(app)(dict(SCOPE), receive, send))
        await started.wait()
        task.cancel()
        begun = asyncio.get_running_loop().time()
        await asyncio.wait_for(task, 10)  # ends by itself, without an exception
        return asyncio.get_running_loop().time() - begun

    took = asyncio.run(main())
    assert cancelled_answer.LAST_WORDS_S <= took < cancelled_answer.LAST_WORDS_S + 2
