"""The decode worker process: continuous batching over claimed hand-offs.

Start-up story: pin cores → load the model → size the KV cache → attach the
rings → report ready → serve. Each loop iteration: read control messages,
claim hand-offs that fit, run one step (decode, or the recompute of preempted
requests), stream the new tokens to the front end. Idle, it sleeps until a control
message or a hand-off doorbell wakes it (``mm_serve.engine.doorbell``).
"""

from __future__ import annotations

import os
import time

import torch

from kernels.ring_buffer import CrossModalRing
from mm_serve import messages
from mm_serve.engine.doorbell import DoorbellListener
from mm_serve.engine.model_runner import ModelRunner
from mm_serve.engine.request import Request, RequestStatus
from mm_serve.engine.worker_channel import IDLE_WAIT_MS, WorkerChannel
from mm_serve.engine.worker_setup import load_for_worker, pin_and_set_threads
from mm_serve.engine.worker_spec import WorkerSpec
from text_decode.handoff_receiver import HandoffReceiver
from text_decode.sampler import Sampler, sample_requests
from text_decode.scheduler import ContinuousBatchingScheduler
from text_decode.stop_checker import check_stop_token

ABORT_MEMORY_S = 600.0  # how long an abort for a not-yet-seen hand-off is remembered


class DecodeWorker:
    """Decodes every request handed to it until it finishes."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        pin_and_set_threads(spec)
        self.model_config, self.model, self.kv_cache, self.config = load_for_worker(spec)
        self.runner = ModelRunner(
            self.model, self.kv_cache, cuda_graphs=self.config.use_cuda_graphs, max_batch=self.config.max_running,
        )
        self.rings = [CrossModalRing.attach(r) for r in spec.rings]
        self.receiver = HandoffReceiver(self.rings, self.kv_cache)
        self.scheduler = ContinuousBatchingScheduler(
            self.kv_cache.pool, self.config.page_size, self.config.max_running,
            self.config.prefill_token_budget, self.config.prefill_batch_size,
        )
        self.sampler = Sampler()
        self.channel = WorkerChannel(spec.control_address, spec.output_address, messages.ToDecode, spec.parent_pid)
        self.doorbell = DoorbellListener(spec.doorbell_address) if spec.doorbell_address else None
        if self.doorbell is not None:
            self.channel.listen_to(self.doorbell)
        self.max_model_len = self.config.resolved_max_model_len(self.model_config.text)
        self.requests: dict[str, Request] = {}
        self._generators: dict[str, torch.Generator | None] = {}
        self._events: dict[str, dict[str, float]] = {}
        self._aborted: set[str] = set()
        self._aborted_at: dict[str, float] = {}
        self._next_stats = 0.0

    def _on_message(self, msg: object) -> bool:
        if isinstance(msg, messages.AbortRequest):
            self._abort(msg.request_id)
        elif isinstance(msg, messages.StatsQuery):
            self._send_stats()
        elif isinstance(msg, messages.Shutdown):
            return False
        return True

    def _abort(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            self._aborted.add(request_id)
            self._aborted_at[request_id] = time.monotonic()
            return
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self._forget(request_id)
        self.channel.send(messages.TokenBatch("decode", self.spec.index, [
            messages.TokenUpdate(request_id, len(request.output_token_ids), [], None, "abort")
        ]))

    def _forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._generators.pop(request_id, None)
        self._events.pop(request_id, None)

    def _expire_aborts(self) -> None:
        cutoff = time.monotonic() - ABORT_MEMORY_S
        for rid in [r for r, t in self._aborted_at.items() if t < cutoff]:
            self._aborted.discard(rid)
            del self._aborted_at[rid]

    def _claim(self) -> None:
        for request, generator, events in self.receiver.claim_ready(self.scheduler.can_admit, self._aborted):
            self.requests[request.request_id] = request
            self._generators[request.request_id] = generator
            self._events[request.request_id] = events
            self.scheduler.add_running(request)

    def _step(self) -> None:
        plan = self.scheduler.schedule()
        if plan.empty:
            return
        if plan.prefill:  # recompute of preempted requests: token ids + kept image embeddings
            batch, logits = plan.prefill, self.runner.prefill(plan.prefill)
        else:
            batch, logits = plan.decode, self.runner.decode(plan.decode)
        tokens, logprobs = sample_requests(self.sampler, logits, batch, self._generators)
        now = time.time()
        updates = []
        for request, token, lp in zip(batch, tokens, logprobs, strict=True):
            events = self._events[request.request_id]
            events.setdefault("first_decode", now)
            start = len(request.output_token_ids)
            request.output_token_ids.append(token)
            status = check_stop_token(request, token, frozenset(), self.max_model_len)
            finish = None if status is None else request.finish_reason_for(status)
            update = messages.TokenUpdate(request.request_id, start, [token], None if lp is None else [lp], finish)
            if status is not None:
                events["finished"] = now
                update.stop_reason = token if finish == "stop" else None
                update.events = events
                self.scheduler.finish(request, status)
                self._forget(request.request_id)
            updates.append(update)
        self.channel.send(messages.TokenBatch("decode", self.spec.index, updates))

    def _send_stats(self) -> None:
        pool = self.kv_cache.pool
        self.channel.send(messages.WorkerStats(
            role="decode", index=self.spec.index, pid=os.getpid(), running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting), kv_pages_used=pool.num_used, kv_pages_total=pool.num_pages,
            ring_slots_used=sum(r.slots_used() for r in self.rings), queued_tokens=0,
            num_preemptions=self.scheduler.num_preemptions, num_encoded_images=0, pages_integrity_ok=pool.integrity_ok(),
        ))

    def serve(self) -> None:
        """Report ready, then loop until :class:`Shutdown` or the parent process dies."""
        self.channel.send(messages.WorkerReady("decode", self.spec.index, os.getpid(), self.kv_cache.num_pages))
        running = True
        idle_wait_ms = 0
        while running and self.channel.parent_alive():
            for msg in self.channel.recv(idle_wait_ms):
                running = running and self._on_message(msg)
            self._claim()
            if self.scheduler.num_unfinished:
                self._step()
                idle_wait_ms = 0
            else:  # woken early by a control message or a hand-off doorbell
                idle_wait_ms = IDLE_WAIT_MS if self.doorbell is not None else 1
            if time.monotonic() >= self._next_stats:
                self._next_stats = time.monotonic() + self.spec.stats_interval_s
                self._expire_aborts()
                self._send_stats()

    def close(self) -> None:
        for ring in self.rings:
            ring.close()
        if self.doorbell is not None:
            self.doorbell.close()
        self.channel.close()
