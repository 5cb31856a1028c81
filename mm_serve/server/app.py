"""The service's ASGI app: the OpenAI-compatible API (:mod:`mm_serve.api`) with the Batch API
(:mod:`mm_serve.batch`) and the console's playground and dashboard (:mod:`mm_serve.console`) joined to it."""

from __future__ import annotations

from fastapi import FastAPI

from mm_serve.api.app import build_api
from mm_serve.batch.routes import BatchAPI
from mm_serve.console.routes import Console
from mm_serve.pipeline.context import ServerContext


def build_app(ctx: ServerContext, start_engine: bool = True) -> FastAPI:
    """The app for ``ctx``; with ``start_engine`` the workers start with the app's lifespan (and
    unfinished batches resume once they are ready)."""
    return build_api(ctx, start_engine, [BatchAPI(ctx), Console(ctx)])
