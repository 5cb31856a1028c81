"""One OpenAI call to an admitted generation, in the order the steps happen.

1. The body is parsed once (:class:`~mm_serve.pipeline.call.Call`): model, tier, prompts.
2. A service shutting down refuses it (503).
3. The early check refuses it on what it is certain to cost, before its images are touched.
4. Its media work (images fetched and decoded, prompts templated and tokenized) runs under its
   image bytes' hold and is decided by its decision deadline.
5. ``max_tokens`` is resolved and the context checked, once per prompt.
6. The work limit; the engine must be up (503); the never-refused tier may wait in the
   dispatch hold; the queue caps and the latency prediction admit or refuse it.
7. Each prompt's ``n`` engine requests are submitted (:class:`~mm_serve.pipeline.generation.Generation`).

HTTP routes, Batch API rows and the caption job all call :func:`admit_call`; a refusal leaves it
as an :class:`~mm_serve.protocol.errors.APIError` in OpenAI's format.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
from dataclasses import dataclass

from mm_serve.admission.predictor import Prediction
from mm_serve.admission.rejection import Rejection
from mm_serve.engine.engine_client import EngineClient
from mm_serve.inputs.input_processor import InvalidRequestError, ProcessedInputs
from mm_serve.media.media_runner import RunCPU
from mm_serve.media.video_loading import Reserve
from mm_serve.pipeline.call import Body, Call, check_model
from mm_serve.pipeline.context import ServerContext
from mm_serve.pipeline.gate import AdmissionGate, Gate, OpenGate, Prepared
from mm_serve.pipeline.generation import Generation, engine_id
from mm_serve.pipeline.media import chat_request, process_inputs, video_limits
from mm_serve.pipeline.origin import CallOrigin
from mm_serve.pipeline.refusal import from_rejection
from mm_serve.protocol.errors import bad_request
from mm_serve.runtime.grammar_spec import GrammarAllowsNothing, GrammarError
from mm_serve.runtime.page_hashes import request_salt


@dataclass(frozen=True)
class AdmittedCall:
    """A call admitted and submitted: one :class:`Generation` per prompt (a chat call has one)."""

    call: Call
    prediction: Prediction | None  # of its first request (None: none was made)
    generations: list[Generation]

    def abort(self, failure: str | None = None) -> None:
        """Cancel every unfinished request of the call (with ``failure``: they end failed, :meth:`Generation.abort`)."""
        for generation in self.generations:
            generation.abort(failure)


async def admit_call(ctx: ServerContext, body: Body, origin: CallOrigin) -> AdmittedCall:
    """Take ``body`` through the steps of the module docstring.

    Raises:
        APIError: 400 bad input, 404 unknown model, 429 refused by admission (Retry-After),
            503 the service cannot take it now.
        ConnectionAbortedError: the client left while the call waited in the dispatch hold.
    """
    try:
        return await _admit(ctx, body, origin)
    except Rejection as rejection:
        raise from_rejection(rejection) from None


async def _admit(ctx: ServerContext, body: Body, origin: CallOrigin) -> AdmittedCall:
    origin.mark("parse")  # the body read, parsed and validated
    check_model(body.model, ctx.served_model_name, str(ctx.holder.model_dir))
    call = Call.parse(body, ctx.config.slo.default, origin.arrival, ctx.config.api)
    call.check_values(ctx.holder.model_config.text.vocab_size)
    if call.grammar is not None:
        call = dataclasses.replace(call, grammar_compile_s=await _compile_grammar(ctx, *call.grammar))
    gate: Gate = AdmissionGate(ctx) if ctx.admission_gate else OpenGate()
    with ctx.admitting_call():  # a drain that begins from here on waits for the call
        gate.refuse_if_draining()
        recheck = gate.precheck(call)
        origin.mark("precheck")
        await gate.hold_media(call, origin.gone)
        processed, committed = await gate.media(call, recheck,
                                                lambda reserve, run: _prompt_inputs(ctx, call, origin.tenant, reserve,
                                                                                    run),
                                                origin.release_body)
        origin.mark("media")  # images fetched and decoded, the prompts templated and tokenized
        prepared = [(inputs, call.sampling_params(len(inputs.prompt_token_ids), ctx.context_len))
                    for inputs in processed]
        gate.check_work(call, prepared)
        client = ctx.client_or_503()  # 503 for a call whose media work ended in a drain
        await gate.hold(call, prepared, origin.gone)  # a call held when the drain began is still served
        origin.mark("hold")
        prediction = gate.admit(call, prepared, committed)
        origin.mark("admit")
        return AdmittedCall(call, prediction, _submit(ctx, client, call, prepared, prediction))


async def _compile_grammar(ctx: ServerContext, spec: tuple[str, str], param: str) -> float:
    """Compile the grammar a call asks for, in a thread (the workers' compilers do the same; this one
    finds a grammar that cannot be compiled, or with which no output can start, before any work is done for
    the call). Returns the seconds the compile took (~0 for a grammar compiled before: xgrammar's compiler
    caches by grammar).

    Raises:
        APIError: 400 ``invalid_grammar`` naming the field and xgrammar's reason, or saying that it allows no
            output (:meth:`~mm_serve.runtime.structured_output.GrammarBook.check_start`); 400
            ``grammar_too_complex`` when it takes longer than ``api.max_grammar_compile_s`` (the compile
            goes on in its thread; the grammar is remembered and refused at once when sent again).
    """
    limit = ctx.config.api.max_grammar_compile_s
    too_complex = (f"the {param} grammar did not compile within api.max_grammar_compile_s ({limit:g} s): make it "
                   "simpler (fewer nested or optional parts)")
    if ctx.grammars.known_slow(spec):
        raise bad_request(too_complex, param, "grammar_too_complex")
    vocab_size = ctx.holder.model_config.text.vocab_size
    await asyncio.to_thread(ctx.grammars.warm, vocab_size)  # once per process: not the grammar's time
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    took = [0.0]

    def compile_it() -> None:  # on a daemon thread: a compile under way never holds up the server's exit
        start = time.perf_counter()
        try:
            ctx.grammars.check_start(spec, vocab_size)  # compiles it first
            outcome: BaseException | None = None
        except BaseException as exc:  # handed to the awaiting call
            outcome = exc
        took[0] = time.perf_counter() - start
        try:
            loop.call_soon_threadsafe(_settle, done, outcome)
        except RuntimeError:  # the loop has closed (the server stopped meanwhile)
            pass

    threading.Thread(target=compile_it, name="grammar-compile", daemon=True).start()
    try:
        await asyncio.wait_for(asyncio.shield(done), limit)
    except TimeoutError:
        ctx.grammars.mark_slow(spec)
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # its outcome, when it comes, is read
        raise bad_request(too_complex, param, "grammar_too_complex") from None
    except GrammarAllowsNothing as exc:
        raise bad_request(f"the {param} grammar allows no output: {exc}", param, "invalid_grammar") from None
    except GrammarError as exc:
        raise bad_request(f"the {param} grammar cannot be compiled: {exc}", param, "invalid_grammar") from None
    return took[0]


def _settle(future: asyncio.Future[None], outcome: BaseException | None) -> None:
    if future.done():  # the call was cancelled meanwhile
        return
    if outcome is None:
        future.set_result(None)
    else:
        future.set_exception(outcome)


async def _prompt_inputs(ctx: ServerContext, call: Call, tenant: str, reserve: Reserve | None = None,
                         run: RunCPU = asyncio.to_thread) -> list[ProcessedInputs]:
    """The call's media work: each prompt processed (images and videos loaded, each video's decoding given
    to ``reserve``; templated, tokenized; a chat call's by ``run``), its caches salted by its ``cache_salt``
    and ``tenant``."""
    api, inputs = ctx.config.api, ctx.holder.inputs
    if call.chat is not None:
        given = getattr(call.body, "mm_processor_kwargs", None)
        kwargs = {} if given is None else given.model_dump(exclude_none=True)
        try:
            limits = inputs.video_limits(kwargs, video_limits(api))
        except InvalidRequestError as exc:
            raise bad_request(str(exc), exc.param or "messages") from None
        vision = ctx.holder.model_config.vision
        takes_video = vision is not None and vision.video_token_index is not None
        request = await chat_request(call.chat, api, limits, reserve, takes_video, takes_images=vision is not None,
                                     run=run)
        if kwargs:
            request["mm_processor_kwargs"] = kwargs
        tools = getattr(call.body, "tools", None)
        if tools:
            request["tools"] = [tool.model_dump(exclude_none=True) for tool in tools]
        processed = [await process_inputs(inputs, request, call.chat.text_chars, api.max_request_length, run)]
    else:
        processed = [await process_inputs(inputs, prompt, len(prompt.get("prompt", "")), api.max_request_length)
                     for prompt in call.prompts]
    salt = request_salt(call.body.cache_salt, tenant)
    for one in processed:  # before anything hashes its images or pages
        one.cache_salt = salt
    return processed


def _submit(ctx: ServerContext, client: EngineClient, call: Call, prepared: Prepared,
            prediction: Prediction | None) -> list[Generation]:
    """Submit each prompt's requests; the prediction (of the first prompt's first copy) is kept for
    the predictor to learn from. On a failure the requests already submitted are aborted.

    Raises:
        APIError: 400 (context) or 503 (no worker left) from a submission.
    """
    generations: list[Generation] = []
    max_wait_s = ctx.config.slo.ageing_s(call.tier)
    call_id = uuid.uuid4().hex  # the first prompt's; its first request is the one predicted
    first = engine_id(call_id, 0)
    try:
        for k, (inputs, params) in enumerate(prepared):
            predicted = prediction if k == 0 else None
            if predicted is not None:
                ctx.admission.remember(first, predicted)  # before it is submitted: it may finish at once
            generations.append(Generation(client, inputs, params, call.arrival, call.tier, max_wait_s,
                                          None if predicted is None else predicted.ttft_s,
                                          call_id if k == 0 else None))
    except BaseException:
        ctx.admission.forget(first)
        for generation in generations:
            generation.abort()
        raise
    return generations
