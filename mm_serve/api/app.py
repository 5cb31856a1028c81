"""The FastAPI application: OpenAI-compatible routes, health, version, internal stats."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge

from mm_serve import __version__
from mm_serve.admission.attainment_feedback import FEEDBACK_SLOS
from mm_serve.admission.controller import NEVER_REFUSED
from mm_serve.admission.tiers import TIERS
from mm_serve.api.api_key import api_key_ok, unauthorized
from mm_serve.api.batch_routes import add_batch_routes
from mm_serve.api.body_limit import ArrivalTimeMiddleware, BodyLimitMiddleware
from mm_serve.api.chat import create_chat_completion
from mm_serve.api.completions import create_completion
from mm_serve.api.context import ServerContext
from mm_serve.api.errors import install_error_handlers
from mm_serve.api.request_builder import check_model
from mm_serve.api.schemas import (
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
from mm_serve.batch.service import BatchService
from mm_serve.metrics.service_metrics import (
    FaultCollector,
    ServiceMetrics,
    WorkerStatsCollector,
    cache_health,
    render,
)
from mm_serve.metrics.tier_metrics import TierMetrics
from mm_serve.runtime import messages

UPLOAD_OVERHEAD_BYTES = 1 << 20
"""What a multipart upload may add to ``batch.max_file_bytes`` (boundaries, part headers, the purpose)."""

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in ((400, "Bad request"), (401, "Missing or wrong API key"), (404, "Unknown model"),
                       (413, "Body too large"), (429, "Refused by admission control (Retry-After)"),
                       (503, "Service unavailable"))
}


def _fastapi(**kwargs: Any) -> FastAPI:
    """The app, with /docs and /redoc served from the Swagger UI / ReDoc assets shipped in
    fastapi-offline (no CDN, so they work offline); FastAPI's CDN pages where it is not installed."""
    try:
        from fastapi_offline import FastAPIOffline
    except ImportError:
        return FastAPI(**kwargs)
    return FastAPIOffline(**kwargs)


def build_app(ctx: ServerContext, start_engine: bool = True) -> FastAPI:
    """The ASGI app for ``ctx``; with ``start_engine`` the workers start with the app's lifespan
    (and unfinished batches resume once they are ready)."""
    batches = BatchService(ctx)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if start_engine:
            ctx.holder.start_background()
            batches.start()
        try:
            yield
        finally:
            await batches.close()
            if start_engine:
                await asyncio.to_thread(ctx.holder.stop)

    app = _fastapi(title="mm-serve", version=__version__, lifespan=lifespan,
                   description="OpenAI-compatible multimodal serving with prefill/decode disaggregation.")
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry)
    Gauge("mm_serve_image_bytes_in_flight", "Bytes of the image budget (admission.max_image_bytes_in_flight) held now "
          "by request bodies being read and images being fetched, decoded and preprocessed.",
          registry=registry).set_function(lambda: ctx.image_budget.reserved)
    registry.register(WorkerStatsCollector(lambda: dict(ctx.holder.client.stats)))
    registry.register(FaultCollector(ctx.holder.client.fault_report))
    ctx.holder.client.finish_listeners.append(metrics.observe_finished)
    ctx.tier_metrics = TierMetrics(registry, ctx.config.slo)
    ctx.holder.client.finish_listeners.extend([ctx.tier_metrics.observe_finished, ctx.admission.on_finished])
    for rank, name in enumerate(TIERS):
        if name == NEVER_REFUSED:
            continue
        for slo in FEEDBACK_SLOS:
            ctx.tier_metrics.follow_limit_factor(name, slo, functools.partial(ctx.admission.limit_factor, rank, slo))
    ctx.holder.client.step_listeners.append(ctx.admission.on_step)
    if ctx.config.scheduler.prefill_speed_routing:
        ctx.holder.client.step_listeners.append(_route_by_speed(ctx))
    install_error_handlers(app, metrics.observe_rejected)
    upload_limit = (ctx.config.batch.max_file_bytes + UPLOAD_OVERHEAD_BYTES, "batch.max_file_bytes, plus 1 MiB of form")
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=ctx.config.api.max_body_bytes,
                       path_limits={"/v1/files": upload_limit}, budget=ctx.image_budget,
                       budget_paths=frozenset({"/v1/chat/completions", "/v1/completions"}), on_refused=metrics.observe_rejected,
                       api_key=ctx.config.api.api_key, idle_timeout_s=ctx.config.api.body_idle_timeout_s,
                       read_timeout_s=ctx.config.api.body_read_timeout_s, stopping=ctx.drain_retry_after_s)
    app.add_middleware(ArrivalTimeMiddleware)

    async def require_key(request: Request) -> None:
        if not api_key_ok(request.headers.get("authorization", ""), ctx.config.api.api_key):
            raise unauthorized()

    auth = [Depends(require_key)]
    add_batch_routes(app, batches, auth)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS, dependencies=auth,
              summary="Chat completion (text and images); set stream=true for SSE chunks")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        return await create_chat_completion(body, request, ctx)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS, dependencies=auth,
              summary="Text completion; set stream=true for SSE chunks")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await create_completion(body, request, ctx)

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

    @app.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    async def health() -> JSONResponse:
        status, workers, faults = ctx.holder.health()
        body = HealthResponse(status=status, workers=workers, faults=faults,  # type: ignore[arg-type]
                              admission={"predict": ctx.config.admission.predict,
                                         **ctx.admission.report(), "held": _held(ctx),
                                         "image_bytes_in_flight": ctx.image_budget.reserved,
                                         "max_image_bytes_in_flight": ctx.image_budget.capacity,
                                         "attainment_feedback": ctx.admission.feedback_report()},
                              caches=cache_health(dict(ctx.holder.client.stats)),
                              event_loop=_loop_name()).model_dump()
        return JSONResponse(body, status_code=200 if status in ("ok", "degraded") else 503)

    @app.get("/metrics", summary="Prometheus metrics (text exposition format)")
    async def metrics_endpoint() -> Response:
        return Response(render(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__, model=ctx.served_model_name)

    @app.get("/internal/stats", dependencies=auth, summary="Per-worker KV pages, queues and counters")
    async def stats() -> dict[str, Any]:
        client = ctx.client_or_503()
        fresh = await asyncio.to_thread(client.query_stats)
        return {f"{role}{index}": {f: getattr(s, f) for f in s.__struct_fields__} for (role, index), s in fresh.items()}

    return app


def _loop_name() -> str:
    """The running event loop's package: "uvloop" or "asyncio"."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def _held(ctx: ServerContext) -> dict[str, int]:
    """The dispatch hold for /health: calls waiting now (and their engine requests), and counts since start."""
    requests, tokens = ctx.dispatch_hold.queued()
    return {"requests_waiting": requests, "prompt_tokens_waiting": tokens, "calls_held": ctx.dispatch_hold.num_held,
            "released_by_time": ctx.dispatch_hold.num_released_by_time}


def _route_by_speed(ctx: ServerContext) -> Callable[[str, int, messages.StepTiming], None]:
    """A step listener that passes the predictor's refitted speed of each prefill worker to the
    router after each of its batches (the router then weighs the work queued on each worker by it)."""

    def listener(role: str, index: int, step: messages.StepTiming) -> None:
        router = ctx.holder.client.router
        if step.kind == "prefill" and role in ("prefill", "colocated") and router is not None:
            router.set_prefill_speed(index, ctx.admission.predictor.prefill_scale(index))

    return listener
