"""One API call's ``n`` engine requests, watched from the asyncio event loop.

Token updates arrive on the engine client's receiver thread; each
:class:`RequestState` listener hands a notification to the loop with
``call_soon_threadsafe``. Nothing here blocks the loop.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

from mm_serve.engine.engine_client import EngineClient
from mm_serve.engine.request_state import RequestState
from mm_serve.ground.tiers import Tier
from mm_serve.inputs.input_processor import InvalidRequestError, ProcessedInputs
from mm_serve.protocol.errors import bad_request, unavailable
from mm_serve.protocol.schemas import PromptTokensDetails, Usage
from mm_serve.runtime.sampling_params import SamplingParams

DISCONNECT_POLL_S = 0.25
DEADLINE_PASSED = "it did not finish by its deadline"  # why a request the deadline ended failed


def engine_id(request_id: str, index: int) -> str:
    """The engine request id of choice ``index`` of the call ``request_id``."""
    return f"{request_id}-{index}"


class Generation:
    """Submits ``params.n`` requests (seeds ``seed + i``) of one prompt and reports their progress.

    Args:
        client: the engine client.
        inputs, params: the processed prompt and its sampling parameters.
        arrival_time: when the call arrived (``time.monotonic()`` seconds).
        tier: its SLO tier (None: standard, not counted per tier) and ``max_wait_s`` its prefill ageing.
        predicted_ttft_s: the admission's TTFT prediction of the first request, seconds (for the metrics).
        request_id: the call's id (default: a fresh one); choice ``i`` runs as :func:`engine_id` (id, i).

    Raises (constructor):
        APIError: 400 when the prompt and ``max_tokens`` do not fit the context, 503 when the
            service cannot take requests.
    """

    def __init__(
        self, client: EngineClient, inputs: ProcessedInputs, params: SamplingParams, arrival_time: float | None = None,
        tier: Tier | None = None, max_wait_s: float = 0.0, predicted_ttft_s: float | None = None,
        request_id: str | None = None,
    ) -> None:
        self.client = client
        self.tier = tier
        self.request_id = request_id or uuid.uuid4().hex
        self.num_prompt_tokens = len(inputs.prompt_token_ids)
        self.prompt_token_ids = list(inputs.prompt_token_ids)
        self.states: list[RequestState] = []
        self._queue: asyncio.Queue[int] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        try:
            for i in range(params.n):
                seed = None if params.seed is None else params.seed + i
                one = replace(params, n=1, seed=seed)
                state = client.submit(engine_id(self.request_id, i), inputs, one, arrival_time, tier, max_wait_s,
                                      predicted_ttft_s if i == 0 else None, counts_inputs=i == 0)
                state.listener = self._notifier(loop, i)
                self.states.append(state)
                self._queue.put_nowait(i)  # in case updates arrived before the listener was set
        except InvalidRequestError as exc:
            self.abort()
            raise bad_request(str(exc), "messages", "context_length_exceeded") from None
        except RuntimeError as exc:
            self.abort()
            raise unavailable(str(exc)) from None

    def _notifier(self, loop: asyncio.AbstractEventLoop, index: int) -> Callable[[RequestState], None]:
        def notify(_: RequestState) -> None:
            loop.call_soon_threadsafe(self._queue.put_nowait, index)

        return notify

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.states)

    def abort(self, failure: str | None = None) -> None:
        """Cancel every unfinished request of this call (pages are freed by the workers); with ``failure``
        they end failed with it rather than cancelled (:meth:`EngineClient.abort`)."""
        for state in self.states:
            if not state.finished:
                self.client.abort(state.request_id, failure)

    async def changes(
        self, deadline: float, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[int]:
        """Yield the index of each request that changed, until all finish, then every index once more.

        Raises:
            TimeoutError: ``deadline`` (``time.monotonic()``) passed; everything unfinished ends failed
                (:data:`DEADLINE_PASSED`).
            ConnectionAbortedError: the client went away; everything is aborted.
        """
        next_poll = time.monotonic() + DISCONNECT_POLL_S
        while not self.finished or not self._queue.empty():
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                self.abort(DEADLINE_PASSED)
                raise TimeoutError
            if now >= next_poll:  # on a clock, so a steady stream of tokens cannot hide a disconnect
                next_poll = now + DISCONNECT_POLL_S
                if is_disconnected is not None and await is_disconnected():
                    self.abort()
                    raise ConnectionAbortedError
            try:
                index = await asyncio.wait_for(self._queue.get(), min(remaining, next_poll - now))
            except TimeoutError:
                continue
            yield index
        # A request can finish on the receiver thread while its notification is still
        # queued for the loop; give every request one last look so none misses its end.
        for index in range(len(self.states)):
            yield index

    async def wait(self, deadline: float, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> None:
        """Wait for every request to finish (same errors as :meth:`changes`)."""
        async for _ in self.changes(deadline, is_disconnected):
            pass

    def usage(self) -> Usage:
        """Token counts: the prompt once, the completion tokens of every choice."""
        completion = sum(len(s.token_ids) for s in self.states)
        return Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=completion,
                     total_tokens=self.num_prompt_tokens + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens))

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV was reused, as counted for the prompt once (its first choice)."""
        return min(self.states[0].cached_tokens, self.num_prompt_tokens) if self.states else 0

    def failed(self) -> RequestState | None:
        """The first of the requests that failed, if any (:attr:`RequestState.failure`)."""
        return next((state for state in self.states if state.failure), None)
