"""The FastAPI application: OpenAI-compatible routes, health, version, metrics, internal stats.

Features above this floor (the Batch API) join through :class:`AppExtension`: their routes,
body limits, start and close, without this module importing them.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.params import Depends as DependsParam
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge
from pydantic import BaseModel

from mm_serve.admission.attainment_feedback import FEEDBACK_SLOS
from mm_serve.api.api_key import matching_key, unauthorized
from mm_serve.api.arrival import ArrivalTimeMiddleware
from mm_serve.api.body_limit import BODY_FILE, BodyLimitMiddleware
from mm_serve.api.body_parser import INLINE_PARSE_BYTES, BodyParser
from mm_serve.api.cancelled_answer import CancelledAnswerMiddleware
from mm_serve.api.chat import create_chat_completion
from mm_serve.api.completions import create_completion
from mm_serve.api.error_handlers import install_error_handlers
from mm_serve.api.openapi_bodies import request_body_spec, with_request_schemas
from mm_serve.ground.roles import Role
from mm_serve.ground.tiers import NEVER_REFUSED, Tier
from mm_serve.ground.version import VERSION
from mm_serve.metrics.service_metrics import (
    FaultCollector,
    ServiceMetrics,
    WorkerStatsCollector,
    cache_health,
    render,
)
from mm_serve.metrics.tier_metrics import TierMetrics
from mm_serve.pipeline.call import check_model
from mm_serve.pipeline.context import WARMING_RETRY_S, ServerContext
from mm_serve.protocol.errors import retry_after
from mm_serve.protocol.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    VersionResponse,
)
from mm_serve.runtime import messages

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in ((400, "Bad request"), (401, "Missing or wrong API key"), (404, "Unknown model"),
                       (413, "Body too large"), (429, "Refused by admission control (Retry-After)"),
                       (503, "Service unavailable"))
}
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})  # bodies held in the image budget


class AppExtension(Protocol):
    """A feature that adds routes to the app (the Batch API)."""

    def body_limits(self) -> dict[str, tuple[int, str]]:
        """Per path, its body limit in bytes and the config key a 413 names (e.g. file uploads)."""
        ...

    def add_routes(self, app: FastAPI, auth: list[DependsParam]) -> None:
        """Register its routes on ``app``, each with the ``auth`` dependencies."""
        ...

    def start(self) -> None:
        """Start with the app, once the engine is starting."""
        ...

    async def close(self) -> None:
        """Stop with the app, before the engine stops."""
        ...


def _fastapi(**kwargs: Any) -> FastAPI:
    """The app, with /docs and /redoc served from the Swagger UI / ReDoc assets shipped in
    fastapi-offline (no CDN, so they work offline); FastAPI's CDN pages where it is not installed."""
    try:
        from fastapi_offline import FastAPIOffline
    except ImportError:
        return FastAPI(**kwargs)
    return FastAPIOffline(**kwargs)


def build_api(ctx: ServerContext, start_engine: bool = True, extensions: Sequence[AppExtension] = ()) -> FastAPI:
    """The ASGI app for ``ctx`` with the routes of ``extensions``; with ``start_engine`` the workers
    start with the app's lifespan, and the extensions start after them."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if start_engine:
            ctx.holder.start_background()
            # once every worker is ready (before, it lengthened the start), and only if the start succeeded
            ctx.grammars.warm_in_background(ctx.holder.model_config.text.vocab_size, after=ctx.holder.ready_event,
                                            wanted=lambda: ctx.holder.started and not ctx.holder.draining.is_set())
            for extension in extensions:
                extension.start()
            await asyncio.to_thread(parser.start)
        try:
            yield
        finally:
            for extension in extensions:
                await extension.close()
            await asyncio.to_thread(parser.close)
            ctx.media_runner.close()
            await asyncio.to_thread(ctx.grammars.close)  # a warm-up under way ends first: exiting in it aborts
            if start_engine:
                await asyncio.to_thread(ctx.holder.stop)

    parser = BodyParser(ctx.config.api)
    app = _fastapi(title="mm-serve", version=VERSION, lifespan=lifespan,
                   description="OpenAI-compatible multimodal serving with prefill/decode disaggregation.")
    registry = CollectorRegistry()
    app.state.registry = registry  # what /metrics renders; extensions read it (the console's dashboard)
    metrics = _wire_metrics(ctx, registry)

    def count_refusal(path: str, status: int) -> None:
        """A generation call refused before its requests ran counts in ``mm_serve_requests_total``; another
        route's error (a file, a batch, an unknown path's 404) is no call."""
        if path in GENERATION_PATHS:
            metrics.observe_rejected(status)

    install_error_handlers(app, count_refusal)
    path_limits = {path: limit for extension in extensions for path, limit in extension.body_limits().items()}
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=ctx.config.api.max_body_bytes, path_limits=path_limits,
                       budget=ctx.image_budget, budget_paths=GENERATION_PATHS, on_refused=count_refusal,
                       api_keys=ctx.config.api.api_keys, idle_timeout_s=ctx.config.api.body_idle_timeout_s,
                       read_timeout_s=ctx.config.api.body_read_timeout_s, stopping=ctx.drain_retry_after_s,
                       wait_s=ctx.config.admission.image_wait_s, spool_bytes=INLINE_PARSE_BYTES)
    app.add_middleware(ArrivalTimeMiddleware)
    app.add_middleware(CancelledAnswerMiddleware)  # outermost

    keys = ctx.config.api.api_keys
    app.state.api_keys = bool(keys)  # whether routes must see a key recorded (mm_serve.batch.routes.call_owner)

    async def require_key(request: Request) -> None:
        if not keys:
            return
        key = matching_key(request.headers.getlist("authorization"), keys)
        if key is None:
            raise unauthorized()
        request.state.api_key = key  # whose files and batches a Batch API call sees (mm_serve.batch.routes)
        if ctx.config.api.cache_salt_by_api_key:
            request.state.tenant = key  # read by http_origin: the call's caches are salted by it

    auth = [Depends(require_key)]
    for extension in extensions:
        extension.add_routes(app, auth)
    _openai_routes(app, ctx, auth, parser)
    _service_routes(app, ctx, registry, auth)
    return app


def _wire_metrics(ctx: ServerContext, registry: CollectorRegistry) -> ServiceMetrics:
    """The service and tier metrics in ``registry``, fed by the engine client's listeners; the
    admission controller learns from the same listeners."""
    metrics = ServiceMetrics(registry)
    Gauge("mm_serve_image_bytes_in_flight", "Bytes of the image budget (admission.max_image_bytes_in_flight) held now "
          "by request bodies being read and images being fetched, decoded and preprocessed.",
          registry=registry).set_function(lambda: ctx.image_budget.reserved)
    client = ctx.holder.client
    Gauge("mm_serve_requests_in_flight", "Engine requests submitted and not yet finished: prefilling, handed off, "
          "decoding, or parked while a worker restarts (n choices of a call are n requests).",
          registry=registry).set_function(lambda: len(client.requests))
    Gauge("mm_serve_calls_admitting", "Calls past the shutdown check and not yet submitted or refused: images "
          "being decoded, prompts tokenized, waiting in the dispatch hold. A drain waits for them too.",
          registry=registry).set_function(lambda: ctx.admitting)
    registry.register(WorkerStatsCollector(lambda: dict(client.stats)))
    registry.register(FaultCollector(client.fault_report))
    ctx.tier_metrics = TierMetrics(registry, ctx.config.slo)
    client.finish_listeners.extend([metrics.observe_finished, ctx.tier_metrics.observe_finished,
                                    ctx.admission.on_finished])
    for tier in Tier:
        if tier == NEVER_REFUSED:
            continue
        for slo in FEEDBACK_SLOS:
            ctx.tier_metrics.follow_limit_factor(tier, slo, functools.partial(ctx.admission.limit_factor, tier, slo))
    client.step_listeners.append(ctx.admission.on_step)
    if ctx.config.scheduler.prefill_speed_routing:
        client.step_listeners.append(_route_by_speed(ctx))
    return metrics


def _openai_routes(app: FastAPI, ctx: ServerContext, auth: list[DependsParam], parser: BodyParser) -> None:
    """``/v1/chat/completions``, ``/v1/completions`` (their bodies parsed by ``parser``) and ``/v1/models``."""

    def parsed(model: type[BaseModel]) -> Any:
        """The route's body as ``model``, parsed off the event loop when large (:class:`BodyParser`)."""

        async def dependency(request: Request) -> BaseModel:
            return await parser.parse(await request.body(), request.headers.get("content-type"), model,
                                      request.scope.get("state", {}).get(BODY_FILE),
                                      request.headers.get("content-encoding"))

        return Depends(dependency)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS, dependencies=auth,
              summary="Chat completion (text and images); set stream=true for SSE chunks",
              openapi_extra=request_body_spec(ChatCompletionRequest))
    async def chat(request: Request, body: ChatCompletionRequest = parsed(ChatCompletionRequest)) -> Any:
        return await create_chat_completion(body, request, ctx)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS, dependencies=auth,
              summary="Text completion; set stream=true for SSE chunks", openapi_extra=request_body_spec(CompletionRequest))
    async def completions(request: Request, body: CompletionRequest = parsed(CompletionRequest)) -> Any:
        return await create_completion(body, request, ctx)

    with_request_schemas(app, [ChatCompletionRequest, CompletionRequest])

    def card() -> ModelCard:
        return ModelCard(id=ctx.served_model_name, created=ctx.created, max_model_len=ctx.context_len,
                         root=str(ctx.holder.model_dir))

    @app.get("/v1/models", response_model=ModelList, dependencies=auth)
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=_ERRORS, dependencies=auth,
             summary="The served model's card; 404 for any other name")
    async def model(model: str) -> ModelCard:
        check_model(model, ctx.served_model_name, str(ctx.holder.model_dir))
        return card()


def _service_routes(app: FastAPI, ctx: ServerContext, registry: CollectorRegistry, auth: list[DependsParam]) -> None:
    """``/health``, ``/metrics``, ``/version`` and ``/internal/stats``."""

    @app.api_route("/health", methods=["GET", "HEAD"], response_model=HealthResponse,  # HEAD: load balancers' probes
                   responses={503: {"model": HealthResponse}})
    async def health() -> JSONResponse:
        status, workers, faults = ctx.holder.health()
        body = HealthResponse(status=status, workers=workers, faults=faults,  # type: ignore[arg-type]
                              admission={"predict": ctx.config.admission.predict,
                                         **ctx.admission.report(), "held": _held(ctx),
                                         "image_bytes_in_flight": ctx.image_budget.reserved,
                                         "max_image_bytes_in_flight": ctx.image_budget.capacity,
                                         "image_calls_waiting": ctx.image_budget.waiting,
                                         "media": {**ctx.media_load.report(), "threads": ctx.media_runner.threads,
                                                   "threads_busy": ctx.media_runner.busy(),
                                                   "steps_waiting": ctx.media_runner.waiting()},
                                         "attainment_feedback": ctx.admission.feedback_report()},
                              caches=cache_health(dict(ctx.holder.client.stats)),
                              event_loop=_loop_name(), placement=ctx.placement).model_dump()
        if status in ("ok", "degraded"):
            return JSONResponse(body)
        retry_s = WARMING_RETRY_S if status == "warming" else ctx.drain_retry_after_s()  # None when down
        return JSONResponse(body, status_code=503, headers=retry_after(retry_s))

    @app.get("/metrics", summary="Prometheus metrics (text exposition format)")
    async def metrics_endpoint() -> Response:
        return Response(render(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=VERSION, model=ctx.served_model_name)

    @app.get("/internal/stats", dependencies=auth, summary="Per-worker KV pages, queues and counters")
    async def stats() -> dict[str, Any]:
        client = ctx.client_or_503()
        fresh = await asyncio.to_thread(client.query_stats)
        return {f"{role}{index}": {f: getattr(s, f) for f in s.__struct_fields__} for (role, index), s in fresh.items()}


def _loop_name() -> str:
    """The running event loop's package: "uvloop" or "asyncio"."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def _held(ctx: ServerContext) -> dict[str, int]:
    """The holds of the never-refused tier for /health: engine requests and prompt tokens waiting now (before
    their media work or their dispatch), calls held since start (before their dispatch; before their media
    work) and how many of those went because their time was up."""
    requests, tokens = ctx.held()
    before, after = ctx.media_hold, ctx.dispatch_hold
    return {"requests_waiting": requests, "prompt_tokens_waiting": tokens, "calls_held": after.num_held,
            "released_by_time": after.num_released_by_time, "calls_held_before_media": before.num_held,
            "released_by_time_before_media": before.num_released_by_time}


def _route_by_speed(ctx: ServerContext) -> Callable[[str, int, messages.StepTiming], None]:
    """A step listener that passes the predictor's refitted speed of each prefill worker to the
    router after each of its batches (the router then weighs the work queued on each worker by it)."""

    def listener(role: str, index: int, step: messages.StepTiming) -> None:
        router = ctx.holder.client.router
        if step.kind == "prefill" and Role(role).prefills and router is not None:
            router.set_prefill_speed(index, ctx.admission.predictor.prefill_scale(index))

    return listener
