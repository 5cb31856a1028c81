"""Submit to an :class:`~mm_serve.engine.engine_client.EngineClient` and await results from asyncio.

The engine client completes :class:`~mm_serve.engine.request_state.RequestState` s
on its receiver thread. :func:`wait_finished` sets each state's ``listener`` to hand
the completion to the event loop with ``call_soon_threadsafe``, so awaiting many
requests costs no thread per request and never blocks the loop.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

from mm_serve.caption.backends import FatalBackendError
from mm_serve.engine.engine_client import EngineClient
from mm_serve.engine.request_state import RequestState
from mm_serve.inputs.input_processor import InvalidRequestError, ProcessedInputs
from mm_serve.runtime.sampling_params import SamplingParams


def submit_all(client: EngineClient, inputs: ProcessedInputs, params: Sequence[SamplingParams]) -> list[RequestState]:
    """Submit one engine request per entry of ``params`` (all with the same inputs).

    Raises:
        InvalidRequestError: prompt plus ``max_tokens`` is over the context length
            (requests already submitted are aborted).
        FatalBackendError: the engine is stopped or a worker is down.
    """
    base = f"caption-{uuid.uuid4().hex}"
    states: list[RequestState] = []
    try:
        for i, p in enumerate(params):
            states.append(client.submit(f"{base}-{i}", inputs, p))
    except InvalidRequestError:
        abort_unfinished(client, states)
        raise
    except RuntimeError as exc:
        abort_unfinished(client, states)
        raise FatalBackendError(str(exc)) from None
    return states


def abort_unfinished(client: EngineClient, states: Sequence[RequestState]) -> None:
    """Abort every state that has not finished (its pages are freed by the workers)."""
    for state in states:
        if not state.finished:
            client.abort(state.request_id)


async def wait_finished(client: EngineClient, states: Sequence[RequestState]) -> None:
    """Wait until every state has finished (tokens, error or abort).

    Raises:
        asyncio.CancelledError: the waiting task was cancelled; the unfinished
            requests are aborted first.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not done.done() and all(s.finished for s in states):
            done.set_result(None)

    def on_change(state: RequestState) -> None:  # runs on the engine client's receiver thread
        if state.finished:
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the loop is already closed (shutdown after the job)
                pass

    for state in states:
        state.listener = on_change
    settle()  # states that finished before their listener was set
    try:
        await done
    except asyncio.CancelledError:
        abort_unfinished(client, states)
        raise
    finally:
        for state in states:
            state.listener = None


def raise_if_engine_down(client: EngineClient, states: Sequence[RequestState]) -> None:
    """Raise :class:`FatalBackendError` when a state failed because the engine went down.

    A request that failed while every worker is still up is a per-input failure
    and is left to the caller.
    """
    errors = [s.error for s in states if s.error]
    if errors and not client.is_ready:
        raise FatalBackendError(f"the engine is down: {errors[0]}")
