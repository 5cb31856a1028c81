"""What every call of one service shares: the engine, the config, the served model's name, and the
admission state (image budget, controller, dispatch hold, seen images, media load and runner, tier metrics)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from mm_serve.admission.byte_budget import ByteBudget
from mm_serve.admission.controller import AdmissionController
from mm_serve.admission.dispatch_hold import DispatchHold
from mm_serve.admission.media_load import MediaLoad
from mm_serve.admission.seen_images import SeenImages
from mm_serve.cluster.launcher import available_cpus
from mm_serve.cluster.worker_specs import engine_sizing
from mm_serve.config import ServiceConfig
from mm_serve.engine.engine_client import EngineClient
from mm_serve.engine.engine_holder import EngineHolder
from mm_serve.ground.tiers import NEVER_REFUSED, Tier
from mm_serve.media.media_runner import MediaRunner, default_threads
from mm_serve.metrics.tier_metrics import TierMetrics
from mm_serve.protocol.errors import unavailable
from mm_serve.runtime.structured_output import GrammarBook

WARMING_RETRY_S = 5  # Retry-After while the workers load the model (seconds; a start takes ~5-30 s)


@dataclass
class ServerContext:
    """Per-service state (one instance per server, or per caption job; no module globals).

    ``admission_gate`` False: the calls pass an :class:`~mm_serve.pipeline.gate.OpenGate` (the caption
    job's own engine: nothing refused, held or predicted) instead of the server's
    :class:`~mm_serve.pipeline.gate.AdmissionGate`.
    """

    holder: EngineHolder
    config: ServiceConfig
    served_model_name: str
    created: int = field(default_factory=lambda: int(time.time()))
    admission_gate: bool = True
    placement: dict[str, Any] | None = None  # how the placement was chosen (mm-serve serve), for /health
    image_budget: ByteBudget = field(init=False)  # bytes of images being decoded at once
    admission: AdmissionController = field(init=False)  # the latency predictor and the admission rule
    dispatch_hold: DispatchHold = field(init=False)  # never-refused calls waiting for spare capacity
    media_hold: DispatchHold = field(init=False)  # never-refused calls with images waiting before their media work
    media_held_bytes: int = field(default=0, init=False)  # the data URIs of the calls in media_hold (their bodies)
    seen_images: SeenImages = field(init=False)  # image URLs sent lately (the early check counts the others)
    media_load: MediaLoad = field(init=False)  # calls fetching/decoding images or tokenizing now (the decision deadline)
    media_runner: MediaRunner = field(init=False)  # the threads that decode and preprocess calls' images, tighter first
    tier_metrics: TierMetrics | None = None  # set by build_app
    grammars: GrammarBook = field(init=False)  # compiles (and so checks) the grammars calls ask for
    admitting: int = field(default=0, init=False)  # calls past the drain's check, not yet submitted or refused

    def __post_init__(self) -> None:
        self.image_budget = ByteBudget(self.config.admission.max_image_bytes_in_flight)
        self.admission = AdmissionController(self.config)
        self.dispatch_hold = DispatchHold()
        self.media_hold = DispatchHold()
        self.seen_images = SeenImages()
        # the media threads are bulk work as the workers' steps are: at their niceness, below the event loop's
        self.media_runner = MediaRunner(self.config.api.media_threads or default_threads(len(available_cpus())),
                                        self.config.compute.worker_nice)
        self.media_load = MediaLoad(lanes=self.media_runner.threads)
        self.grammars = GrammarBook(self.holder.model_dir)

    def held(self) -> tuple[int, int]:
        """(engine requests, prompt tokens) of the never-refused calls held now, before their media work
        (their images' fewest tokens) and before their dispatch."""
        before, after = self.media_hold.queued(), self.dispatch_hold.queued()
        return before[0] + after[0], before[1] + after[1]

    @property
    def context_len(self) -> int:
        """Prompt plus output tokens at most (the checkpoint's limit, capped by one worker's KV pages)."""
        return engine_sizing(self.config).context_limit(self.holder.model_config.text)

    def refuse_if_draining(self) -> None:
        """503 while the service is shutting down (before a call's images are decoded for nothing).

        Raises:
            APIError: 503 with ``Retry-After``: at most what is left of the grace period, after which
                a restarted service (or another replica behind the same address) can answer.
        """
        left = self.drain_retry_after_s()
        if left is not None:
            raise unavailable("the service is shutting down; in-flight requests are finishing", left)

    @contextmanager
    def admitting_call(self) -> Iterator[None]:
        """Count a call in :attr:`admitting` while it is admitted (its media work, the dispatch hold, the
        checks, up to its submission or refusal): the drain waits for these as for submitted requests.
        Enter it before the call's check for a drain (:meth:`refuse_if_draining`), so a signal between
        the two cannot leave a call out of both: the drain then sees it, or it sees the drain. On the
        event loop's thread only."""
        self.admitting += 1
        try:
            yield
        finally:
            self.admitting -= 1

    def drain_retry_after_s(self) -> int | None:
        """While the service is shutting down, the seconds left of its grace period (at least 1: the
        ``Retry-After`` of its 503s); None while it serves."""
        if not self.holder.draining.is_set():
            return None
        return max(1, math.ceil(self.holder.drain_deadline - time.monotonic()))

    def client_or_503(self) -> EngineClient:
        """The engine client, or 503 while it is warming up, failed to start or shutting down.

        Once started it is returned even while a worker restarts: requests then wait for it
        (bounded by ``api.timeout_ms``), and :meth:`EngineClient.submit` refuses them when a
        role has no worker left.
        """
        self.refuse_if_draining()
        if not self.holder.started:
            status = self.holder.health()[0]
            if status == "warming":
                raise unavailable("the service is warming; try again shortly", WARMING_RETRY_S)
            raise unavailable("the service is unavailable (it failed to start; see /health)")
        return self.holder.client

    def decision_deadline(self, arrival: float | None, tier: Tier) -> float | None:
        """When (``time.monotonic()`` seconds) a call of ``tier`` that arrived at ``arrival`` is
        decided at the latest (:mod:`mm_serve.pipeline.decision_deadline`): ``arrival +
        admission.decide_within_ms``; None when there is nothing to decide early (prediction off,
        the never-refused tier, the key 0, no arrival time)."""
        ms = self.config.admission.decide_within_ms
        if arrival is None or ms == 0 or not self.config.admission.predict or tier == NEVER_REFUSED:
            return None
        return arrival + ms / 1000.0

    def deadline(self) -> float:
        """When (``time.monotonic()`` seconds) a call starting now is past ``api.timeout_ms``."""
        return time.monotonic() + self.config.api.timeout_ms / 1000.0
