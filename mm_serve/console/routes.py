"""The console's routes, joined to the app as an :class:`~mm_serve.api.app.AppExtension`:

- ``GET /playground`` and ``GET /dashboard``: the two pages (HTML, JavaScript and CSS shipped in
  ``mm_serve/console/static/``; the charting library is plotly's ``plotly.min.js``, served from the
  installed ``plotly`` package). Nothing is fetched from anywhere but this server.
- ``GET /console/static/{name}``: those assets.
- ``GET /internal/console``: what the playground needs to know of the model (behind ``--api-key``).
- ``GET /internal/dashboard``: the dashboard's data (:func:`~mm_serve.console.dashboard_state.dashboard_state`,
  behind ``--api-key`` like ``/internal/stats``).

The pages themselves are not behind the key: they ask for it, keep it in the tab's session storage, and
send it with every call, like any client.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.params import Depends as DependsParam
from fastapi.responses import FileResponse, HTMLResponse

from mm_serve.console.dashboard_state import dashboard_state
from mm_serve.console.history import MetricsHistory
from mm_serve.console.recent import RecentRequests
from mm_serve.ground.tiers import Tier
from mm_serve.inputs.image_prep import FixedSizeImages
from mm_serve.pipeline.context import ServerContext
from mm_serve.protocol.errors import APIError

STATIC = Path(__file__).parent / "static"
_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}
SAMPLE_EVERY_S = 1.0


def _plotly_js() -> Path:
    """plotly.js as the ``plotly`` Python package ships it (``package_data/plotly.min.js``)."""
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


class Console:
    """The playground and the dashboard (see the module docstring)."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.recent = RecentRequests()
        self.history: MetricsHistory | None = None
        self._task: asyncio.Task[None] | None = None

    def body_limits(self) -> dict[str, tuple[int, str]]:
        """None of its own: it takes no bodies."""
        return {}

    def add_routes(self, app: FastAPI, auth: list[DependsParam]) -> None:
        """The routes of the module docstring; the history reads ``app.state.registry`` (what ``/metrics``
        renders), the waterfall listens to the engine client's finished requests."""
        self.history = MetricsHistory(app.state.registry)
        self.ctx.holder.client.finish_listeners.append(self.recent.observe)
        files = {p.name: p for p in STATIC.iterdir() if p.suffix in _TYPES}
        pages = {name: (STATIC / f"{name}.html").read_text() for name in ("playground", "dashboard")}

        @app.get("/playground", include_in_schema=False)
        async def playground() -> HTMLResponse:
            return HTMLResponse(pages["playground"])

        @app.get("/dashboard", include_in_schema=False)
        async def dashboard() -> HTMLResponse:
            return HTMLResponse(pages["dashboard"])

        @app.get("/console/static/{name}", include_in_schema=False)
        async def asset(name: str) -> FileResponse:
            if name == "plotly.min.js":
                return FileResponse(_plotly_js(), media_type="text/javascript")
            if name not in files:
                raise APIError(404, f"no console asset {name!r}", "invalid_request_error", None, "not_found")
            return FileResponse(files[name], media_type=_TYPES[files[name].suffix])

        @app.get("/internal/console", dependencies=auth, summary="What the playground shows of the model")
        async def console_info() -> dict[str, Any]:
            return self.model_info()

        @app.get("/internal/dashboard", dependencies=auth, summary="The dashboard's data (from the /metrics counters)")
        async def dashboard_data() -> dict[str, Any]:
            assert self.history is not None
            return await asyncio.to_thread(dashboard_state, self.ctx, self.history, self.recent)

    def model_info(self) -> dict[str, Any]:
        """``model`` (the served name), ``vision`` (it takes images), ``detail`` (an image's ``detail``
        changes what it costs: tiled processors), ``context_length`` (tokens) and the ``tiers`` a call may
        name (``service_tier``), with ``default_tier``."""
        holder = self.ctx.holder
        vision = holder.model_config.vision is not None
        processor = getattr(holder.inputs, "image_processor", None)
        return {"model": self.ctx.served_model_name, "vision": vision,
                "detail": vision and processor is not None and not isinstance(processor, FixedSizeImages),
                "context_length": self.ctx.context_len, "tiers": [tier.label for tier in Tier],
                "default_tier": self.ctx.config.slo.default.label}

    def start(self) -> None:
        """Start the history's sampling (a snapshot a second, read in a thread)."""
        self._task = asyncio.ensure_future(self._sample_forever())

    async def _sample_forever(self) -> None:
        assert self.history is not None
        while True:
            await asyncio.to_thread(self.history.sample)
            await asyncio.sleep(SAMPLE_EVERY_S)

    async def close(self) -> None:
        """Stop the sampling."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
