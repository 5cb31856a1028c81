"""One batch row answered by the server's own call pipeline, within the in-flight cap.

A row's body goes through exactly what ``POST /v1/chat/completions`` or ``POST /v1/completions``
runs, non-streamed (:func:`~mm_serve.pipeline.pipeline.admit_call`,
:func:`~mm_serve.pipeline.responses.answer`): the same schema, image rules, tokenization,
sampling mapping and admission, so a row's response body is the one an interactive request
would get, and a request the server would refuse (an undecodable image, a bad parameter, a
queue cap) gets the server's status code and error body in its error row. Rows never fail
the batch.

Batch rows use spare capacity only, as far as the front end can tell: a row starts
only while the engine has fewer than ``batch.max_in_flight_rows`` requests in flight,
interactive ones included, and at most that many rows of all batches are in flight
(a semaphore shared by every batch). Interactive requests are never held back; while
they alone fill the engine to the cap, no batch row starts. A row in the engine runs in
the ``batch`` SLO tier unless its body names another ``service_tier``: prefilled after
interactive and standard work, preempted (and displaced) first, never refused for latency.
"""

from __future__ import annotations

import asyncio
import time

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from mm_serve.caption.backends import CaptionBackend, FatalBackendError
from mm_serve.caption.inputs import COMPLETIONS_URL, CaptionInput
from mm_serve.caption.records import Outcome, answered, refused
from mm_serve.pipeline.context import ServerContext
from mm_serve.pipeline.origin import CallOrigin
from mm_serve.pipeline.pipeline import admit_call
from mm_serve.pipeline.responses import answer
from mm_serve.protocol.batch_rows import answered_whole
from mm_serve.protocol.errors import APIError, validation_error
from mm_serve.protocol.schemas import ChatCompletionRequest, CompletionRequest, dump

SPARE_POLL_S = 0.005


class RowBackend(CaptionBackend):
    """Runs batch rows on the server's engine (a :class:`CaptionBackend` for the caption job loop).

    Args:
        ctx: the server's context (engine holder, config, served model name).
        slots: the shared in-flight cap (``batch.max_in_flight_rows`` permits).
        tenant: whose caches the rows may share (:attr:`CallOrigin.tenant`); "" for the shared ones.
    """

    name = "server engine"

    def __init__(self, ctx: ServerContext, slots: asyncio.Semaphore, tenant: str = "") -> None:
        self.ctx = ctx
        self.slots = slots
        self.tenant = tenant

    @property
    def default_concurrency(self) -> int:
        """``batch.max_in_flight_rows``."""
        return self.ctx.config.batch.max_in_flight_rows

    def engine_up(self) -> bool:
        """True while the engine takes requests (:attr:`EngineHolder.ready`, not draining)."""
        holder = self.ctx.holder
        return holder.ready and not holder.draining.is_set()

    async def run(self, item: CaptionInput) -> Outcome:
        """Answer one row; see the module docstring.

        Raises:
            FatalBackendError: the engine is down, warming or draining (the row is not
                written; a later run does it).
        """
        async with self.slots:
            await self._wait_for_spare_capacity()
            if not self.engine_up():
                raise FatalBackendError("the engine is not taking requests")
            start = time.perf_counter()
            try:
                response = await self._answer(item)
            except APIError as exc:
                if exc.status == 503 and not self.engine_up():
                    raise FatalBackendError(exc.message) from None
                return refused(time.perf_counter() - start, exc)
            return answered(time.perf_counter() - start, dump(response))

    async def _wait_for_spare_capacity(self) -> None:
        """Return once the engine has fewer than ``batch.max_in_flight_rows`` requests in flight
        (interactive and batch), or is not taking requests (the caller then stops)."""
        cap = self.ctx.config.batch.max_in_flight_rows
        client = self.ctx.holder.client
        while len(client.requests) >= cap and self.engine_up():
            await asyncio.sleep(SPARE_POLL_S)

    async def _answer(self, item: CaptionInput) -> BaseModel:
        # rows run in the batch SLO tier (lowest priority, preempted first, never refused for
        # latency) unless the row names another service_tier (null and "auto", like absent: the
        # batch tier is the default of a batch row)
        body = answered_whole(self.ctx.served_model_name, item.body)
        if body.get("service_tier") in (None, "auto"):
            body["service_tier"] = "batch"
        origin = CallOrigin.internal(self.tenant)
        try:
            request = (CompletionRequest if item.url == COMPLETIONS_URL else ChatCompletionRequest).model_validate(body)
        except ValidationError as exc:
            raise validation_error(RequestValidationError(exc.errors())) from None
        admitted = await admit_call(self.ctx, request, origin)
        return await answer(self.ctx, admitted, origin.gone)

    async def aclose(self) -> None:
        """Nothing to release: the engine belongs to the server."""
