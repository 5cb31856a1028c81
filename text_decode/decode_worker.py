"""The decode worker process: continuous batching over claimed hand-offs.

Runs in the :class:`~mm_serve.runtime.worker_shell.WorkerShell`. Each step: claim the
hand-offs that fit, run one scheduler step (decode, or the recompute of preempted
requests) and stream the new tokens to the front end. Idle, it sleeps until a control
message or a hand-off doorbell wakes it (:mod:`mm_serve.transport.doorbell`). With
``decode_step_interval_s`` set it paces its steps: a step starts at least that long after
the previous one began, and the worker sleeps out the rest (claiming hand-offs and reading
messages as they come), so a prefill worker on the same core runs meanwhile; with
``decode_step_pacing`` the interval follows the tightest TPOT SLO among the running requests.
Pinned, it paces only while other processes use its cores (:mod:`mm_serve.runtime.core_load`;
``decode_pacing_always`` paces every step), so alone it decodes at full speed; unpinned (a Ray
actor, a machine without affinity) it paces every step.
"""

from __future__ import annotations

import math
import time

from mm_serve.ground.roles import Role
from mm_serve.runtime import messages
from mm_serve.runtime.core_load import CoreDemand
from mm_serve.runtime.lifetime import LifetimeEvent
from mm_serve.runtime.model_runner import ModelRunner
from mm_serve.runtime.pacing import paced_interval_s
from mm_serve.runtime.post_step import StopCriteria, process_step, token_update
from mm_serve.runtime.request import Request, RequestStatus
from mm_serve.runtime.sampler import Sampler, sample_requests
from mm_serve.runtime.step_clock import StepClock
from mm_serve.runtime.structured_output import GrammarBook
from mm_serve.runtime.warm_up import warm_up
from mm_serve.runtime.worker_setup import load_for_worker
from mm_serve.runtime.worker_shell import WorkerShell
from mm_serve.text_decode.handoff_receiver import HandoffReceiver
from mm_serve.text_decode.scheduler import ContinuousBatchingScheduler
from mm_serve.transport.doorbell import DoorbellListener
from mm_serve.transport.registry import ring_opener

ABORT_MEMORY_S = 600.0  # how long an abort for a not-yet-seen hand-off is remembered
POLL_WAIT_MS = 1  # idle wait with no doorbell: the ring is polled


class DecodeWorker(WorkerShell):
    """Decodes every request handed to it until it finishes."""

    role = Role.DECODE
    accepts = messages.ToDecode

    def load(self) -> None:
        spec = self.spec
        self.model_config, cfg, self.model, self.kv_cache = load_for_worker(spec)
        self.runner = ModelRunner(self.model, self.kv_cache, cuda_graphs=cfg.use_cuda_graphs, max_running=cfg.max_running)
        open_ring = ring_opener(self.link, "consumer")
        self.rings = [open_ring(r) for r in spec.rings]
        self.receiver = HandoffReceiver(self.rings, self.kv_cache, self._handoff_failed, open_ring)
        self.scheduler = ContinuousBatchingScheduler.from_config(self.kv_cache.pool, cfg)
        self.sampler = Sampler()
        self.grammars = GrammarBook(spec.model_dir)  # EOS: in each request's stop tokens (sampling_wire)
        self.stops = StopCriteria(frozenset(), cfg.context_limit(self.model_config.text))
        self.requests: dict[str, Request] = {}
        self._aborted_at: dict[str, float] = {}  # aborts of hand-offs not seen yet: id -> monotonic time
        self._last_step_end: float | None = None  # monotonic time the last decode step was timed; None after idle
        self.pace_s = cfg.decode_step_interval_s
        self.pacing, self.tier_tpot_s = cfg.decode_step_pacing, cfg.tier_tpot_s
        paces = bool(cfg.decode_step_interval_s or cfg.decode_step_pacing) and not cfg.decode_pacing_always
        self.core_demand = CoreDemand(spec.cpus) if paces else None  # None: pace as configured
        self._last_step_begun: float | None = None  # monotonic start of the last step run; None after idle
        self.doorbell = DoorbellListener(spec.doorbell_address) if spec.doorbell_address else None
        if self.link is not None and self.doorbell is not None:
            self.link.wake_with(spec.doorbell_address)  # a delivery over Ray rings it too
        self.wake_on = self.doorbell
        self.idle_wait_ms = self.idle_wait_ms if self.doorbell is not None else POLL_WAIT_MS

    def warm_up(self) -> None:
        warm_up(self.runner, self.stops.max_model_len, encode=False)

    # ---- requests ----------------------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            self._aborted_at[request_id] = time.monotonic()
            return
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        self.send([token_update(request)])

    def replace_ring(self, msg: messages.ReplaceRing) -> None:
        self.receiver.replace_ring(msg.peer_index, msg.ring)

    def _handoff_failed(self, request_id: str, reason: str) -> None:
        print(f"[decode {self.spec.index}] refused the hand-off of {request_id!r}: {reason}", flush=True)
        self.channel.send(messages.HandoffFailed(request_id, reason))

    def _adopt(self, request: Request) -> None:
        """A claimed hand-off joins the running set (at once: the next claim sees it)."""
        self.requests[request.request_id] = request
        self.grammars.prefetch(request, self.model_config.text.vocab_size)  # compiled beside the next forward pass
        self.scheduler.add_running(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        del self.requests[request.request_id]

    def periodic(self) -> None:
        if self.core_demand is not None:
            self.core_demand.others_busy()  # idle too: the next busy step's window is a recent one
        cutoff = time.monotonic() - ABORT_MEMORY_S
        for request_id in [r for r, t in self._aborted_at.items() if t < cutoff]:
            del self._aborted_at[request_id]

    # ---- one step ----------------------------------------------------------------------------

    def busy(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step_interval_s(self) -> float:
        """Seconds from one step's start to the next's at the soonest: ``decode_step_interval_s``, or
        with ``decode_step_pacing`` that fraction of the tightest TPOT SLO among the running requests
        (each by its tier, ``tier_tpot_s``; :func:`mm_serve.runtime.pacing.paced_interval_s`, at most
        :data:`mm_serve.runtime.pacing.MAX_PACED_INTERVAL_S`); 0.0 unpaced, with nothing running,
        or while nothing else uses the worker's cores (:attr:`core_demand`)."""
        ranks = (r.priority for r in self.scheduler.running)
        interval = paced_interval_s(self.pace_s, self.pacing, self.tier_tpot_s, ranks)
        if interval and self.core_demand is not None and not self.core_demand.others_busy():
            return 0.0
        return interval

    def _next_step_at(self) -> float:
        """Monotonic time the next step may start: :meth:`step_interval_s` after the last one began (0.0: now)."""
        interval = self.step_interval_s()
        if not interval or self._last_step_begun is None:
            return 0.0
        return self._last_step_begun + interval

    def wait_ms(self) -> int:
        """While busy and paced, the time to the next step (messages and doorbells end it early)."""
        if not self.busy():
            return self.idle_wait_ms
        return max(0, math.ceil((self._next_step_at() - time.monotonic()) * 1000.0))

    def step(self) -> None:
        begun = time.monotonic()
        clock = StepClock(self.grammars, cpu=False)  # structured-output setup in this step (adopted requests' too)
        aborted = set(self._aborted_at)
        self.receiver.claim_ready(self.scheduler.can_admit, aborted, self._adopt, self.scheduler.displace)
        for request_id in set(self._aborted_at) - aborted:  # their hand-offs were dropped
            del self._aborted_at[request_id]
        if not self.scheduler.num_unfinished:
            self._last_step_end = self._last_step_begun = None  # idle: the next period starts afresh
            return
        allowed = self._next_step_at()
        if begun < allowed:  # paced: woken early by a message or a hand-off
            return
        plan = self.scheduler.schedule()
        if plan.empty:
            self._last_step_end = self._last_step_begun = None
            return
        self._last_step_begun = begun
        batch = plan.prefill or plan.decode
        try:
            if plan.prefill:  # recompute of preempted requests: token ids + kept image embeddings
                logits = self.runner.prefill(plan.prefill)
            else:
                logits = self.runner.decode(plan.decode)
            tokens, logprobs = sample_requests(self.sampler, logits, batch, grammars=self.grammars)
        except Exception as exc:  # one bad step fails its requests, not the worker
            print(f"[decode {self.spec.index}] step of {len(batch)} failed: {exc!r}", flush=True)
            for request in batch:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                self.channel.send(messages.RequestFailed(request.request_id, f"decode failed: {exc}"))
            self._last_step_end = None
            return
        now = time.time()
        for request in batch:
            request.stamp(LifetimeEvent.FIRST_DECODE, now)
        timing = None if plan.prefill else messages.StepTiming(  # the setup is no model work
            "decode", max(0.0, self._step_period(begun, allowed) - clock.setup_s()), len(batch),
            sum(r.num_tokens for r in batch))
        process_step(batch, tokens, logprobs, self.stops, self._finish)
        self.send([token_update(request) for request in batch], timing)

    def _step_period(self, begun: float, allowed: float = 0.0) -> float:
        """Seconds a running request waited for this decode step's token, less any wait for pacing
        (the admission predictor's decode step, :mod:`mm_serve.admission`): since the previous decode
        step was timed, or since pacing let this one start (``allowed``, monotonic; 0.0 unpaced) when
        that came later, when every step in between did work (claims, recompute steps, sending,
        messages and the OS's time slices included; paced, a recompute step's work within the
        interval is left out too), else since this step began. Unpaced, consecutive periods tile the
        busy time exactly; paced, they leave out the sleep (the predictor adds the interval itself:
        :func:`mm_serve.runtime.pacing.paced_interval_s`)."""
        now, last = time.monotonic(), self._last_step_end
        self._last_step_end = now
        return now - (max(last, allowed) if last is not None else begun)

    # ---- stats and close ---------------------------------------------------------------------

    def load_report(self) -> dict[str, int]:
        return {
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "ring_slots_used": sum(r.slots_used() for r in self.receiver.rings), "queued_tokens": 0,
            "num_preemptions": self.scheduler.num_preemptions, "num_encoded_images": 0,
            "ray_handoffs": sum(getattr(r, "num_pulled", 0) for r in self.receiver.rings),
            "ring_pages_held": sum(r.spec.num_pages - r.pages_free() for r in self.receiver.rings),
        }

    def release_resources(self) -> None:
        for ring in self.receiver.rings:
            ring.close()
        if self.link is not None:
            self.link.shutdown()
        if self.doorbell is not None:
            self.doorbell.close()
