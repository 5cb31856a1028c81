"""Owns the :class:`EngineClient` of the API process: starts it in the background, reports health."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from mm_serve.config import ServiceConfig
from mm_serve.engine.engine_client import EngineClient
from mm_serve.engine.input_processor import InputProcessor
from mm_serve.models.model_config import load_model_config


class EngineHolder:
    """Starts the workers without blocking the HTTP server, so ``/health`` can say "warming"."""

    def __init__(self, model_dir: Path, config: ServiceConfig) -> None:
        self.model_dir = model_dir
        self.config = config
        self.model_config = load_model_config(model_dir)
        self.inputs = InputProcessor(model_dir, self.model_config)
        self.client = EngineClient(model_dir, config, self.inputs)
        self.start_error: str | None = None
        self.ready_event = threading.Event()
        self.draining = threading.Event()  # set on SIGTERM/SIGINT: new requests get 503
        self._thread: threading.Thread | None = None

    def start_background(self) -> None:
        self._thread = threading.Thread(target=self._start, name="mm-serve-engine-start", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        try:
            self.client.start()
            self.ready_event.set()
        except Exception as exc:  # reported through /health and the CLI
            self.start_error = str(exc)
            self.ready_event.set()

    @property
    def ready(self) -> bool:
        return self.client.is_ready

    def health(self) -> tuple[str, dict[str, str]]:
        """(``ok`` | ``warming`` | ``stopping`` | ``unavailable``, per-worker status); ``stopping``
        (503) while a SIGTERM/SIGINT drain runs, so load balancers stop sending traffic."""
        if self.start_error is not None:
            return "unavailable", {"engine": f"failed to start: {self.start_error.splitlines()[0]}"}
        info = self.client.health()
        workers: dict[str, str] = info["workers"] or {"engine": "warming"}
        if self.draining.is_set():
            return "stopping", workers
        if info["ok"] and self.ready:
            return "ok", workers
        if any(v.startswith("down") for v in workers.values()):
            return "unavailable", workers
        return "warming", workers

    def drain(self, grace_s: float) -> int:
        """Stop admitting, then wait up to ``grace_s`` seconds for in-flight engine requests to
        finish; returns how many were still in flight at the deadline."""
        self.draining.set()
        deadline = time.monotonic() + grace_s
        while self.client.requests and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(self.client.requests)

    def stop(self) -> None:
        self.client.request_stop()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.client.shutdown()
