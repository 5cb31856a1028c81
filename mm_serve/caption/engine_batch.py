"""OpenAI batch rows on the in-process engine, answered as ``mm-serve serve`` would answer them.

A row goes through the server's own call pipeline (:func:`~mm_serve.pipeline.pipeline.admit_call`)
on a context around the job's engine whose gate admits everything
(:class:`~mm_serve.pipeline.gate.OpenGate`: the job owns its engine, nothing competes with it):
the body is validated with the API's schema, its images loaded under the API's media rules
(``api.*`` of the config: data URIs always; ``file://`` only under
``api.allowed_local_media_path``), its sampling parameters mapped as the API maps them, and the
response body is the one the server would send; a request the server would refuse gets the
server's status code and error body.
"""

from __future__ import annotations

import math
import time

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from mm_serve.caption.backends import FatalBackendError
from mm_serve.caption.inputs import COMPLETIONS_URL, CaptionInput
from mm_serve.caption.records import Outcome, answered, refused
from mm_serve.engine.engine_client import EngineClient
from mm_serve.engine.engine_holder import EngineHolder
from mm_serve.pipeline.context import ServerContext
from mm_serve.pipeline.origin import CallOrigin
from mm_serve.pipeline.pipeline import admit_call
from mm_serve.pipeline.responses import answer
from mm_serve.protocol.batch_rows import answered_whole
from mm_serve.protocol.errors import APIError, validation_error
from mm_serve.protocol.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    dump,
)


class EngineBatchRequests:
    """Runs OpenAI request bodies (chat or completions) on an engine client.

    Args:
        client: a started engine client (not owned).
        model_name: the ``model`` of bodies that name none, and of the responses.
    """

    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name
        holder = EngineHolder(client.model_dir, client.config, client)
        self.ctx = ServerContext(holder, client.config, model_name, admission_gate=False)

    async def run(self, item: CaptionInput, start: float) -> Outcome:
        """Answer the body of ``item``; ``start`` is the input's ``time.perf_counter()`` start.

        Raises:
            FatalBackendError: the engine went down.
        """
        body = answered_whole(self.model_name, item.body)
        origin = CallOrigin.internal()
        try:
            try:
                kind = CompletionRequest if item.url == COMPLETIONS_URL else ChatCompletionRequest
                request = kind.model_validate(body)
            except ValidationError as exc:
                raise validation_error(RequestValidationError(exc.errors())) from None
            admitted = await admit_call(self.ctx, request, origin)
            response = await answer(self.ctx, admitted, origin.gone, deadline=math.inf)
        except APIError as exc:
            if exc.status == 503 and not self.client.is_ready:
                raise FatalBackendError(f"the engine is down: {exc.message}") from None
            return refused(time.perf_counter() - start, exc)
        if isinstance(response, ChatCompletionResponse):
            text = response.choices[0].message.content if response.choices else None
        else:
            text = response.choices[0].text if response.choices else None
        return answered(time.perf_counter() - start, dump(response), (text or "").strip())
