"""The colocated worker process: one engine runs encode, prefill and decode (vLLM-style baseline).

It speaks the same protocol as the disaggregated workers (requests in, token
batches out), so the front end, the API and the benchmarks treat both modes alike.
"""

from __future__ import annotations

import os
import time

from mm_serve import messages
from mm_serve.engine.input_processor import ProcessedInputs
from mm_serve.engine.llm_engine import LLMEngine
from mm_serve.engine.request import Request
from mm_serve.engine.sampling_wire import from_wire
from mm_serve.engine.worker_channel import IDLE_WAIT_MS, WorkerChannel
from mm_serve.engine.worker_setup import engine_config_from_sizing, pin_and_set_threads
from mm_serve.engine.worker_spec import WorkerSpec


class ColocatedWorker:
    """Wraps :class:`LLMEngine` in the worker message loop."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        pin_and_set_threads(spec)
        self.engine = LLMEngine(spec.model_dir, engine_config_from_sizing(spec.sizing))
        self.channel = WorkerChannel(spec.control_address, spec.output_address, messages.ToPrefill, spec.parent_pid)
        self._events: dict[str, dict[str, float]] = {}
        self._sent: dict[str, int] = {}
        self._next_stats = 0.0

    def _on_message(self, msg: object) -> bool:
        if isinstance(msg, messages.PrefillRequest):
            pixels = None if msg.pixel_values is None else msg.pixel_values.to_tensor()
            inputs = ProcessedInputs(list(msg.prompt_token_ids), pixels, msg.num_images)
            self.engine.add_request(msg.request_id, inputs, from_wire(msg.sampling), msg.generator_seed)
            self._events[msg.request_id] = {"arrived": msg.arrival_time, "prefill_queued": time.time()}
            self._sent[msg.request_id] = 0
        elif isinstance(msg, messages.AbortRequest):
            request = self.engine.requests.get(msg.request_id)
            if request is not None:
                self.engine.abort(msg.request_id)
                self._finish(request, [messages.TokenUpdate(msg.request_id, len(request.output_token_ids), [], None, "abort")])
        elif isinstance(msg, messages.StatsQuery):
            self._send_stats()
        elif isinstance(msg, messages.Shutdown):
            return False
        return True

    def _finish(self, request: Request, updates: list[messages.TokenUpdate]) -> None:
        self.engine.release(request.request_id)
        self._events.pop(request.request_id, None)
        self._sent.pop(request.request_id, None)
        self.channel.send(messages.TokenBatch("colocated", self.spec.index, updates))

    def _step(self) -> None:
        updated, finished = self.engine.step_all()
        done = {r.request_id for r in finished}
        now = time.time()
        updates = []
        for request in updated:
            rid = request.request_id
            start = self._sent[rid]
            events = self._events[rid]
            events.setdefault("prefill_end", now)
            lps = request.output_logprobs[start:] if request.sampling_params.logprobs is not None else None
            update = messages.TokenUpdate(rid, start, request.output_token_ids[start:], lps)
            self._sent[rid] = len(request.output_token_ids)
            if rid in done:
                events["finished"] = now
                update.finish_reason = request.finish_reason
                update.stop_reason = request.stop_reason if isinstance(request.stop_reason, int) else None
                update.events = events
            updates.append(update)
        if updates:
            self.channel.send(messages.TokenBatch("colocated", self.spec.index, updates))
        for request in finished:
            self.engine.release(request.request_id)
            self._events.pop(request.request_id, None)
            self._sent.pop(request.request_id, None)

    def _send_stats(self) -> None:
        pool = self.engine.kv_cache.pool
        sched = self.engine.scheduler
        vision = self.engine.model.vision
        self.channel.send(messages.WorkerStats(
            role="colocated", index=self.spec.index, pid=os.getpid(), running=len(sched.running),
            waiting=len(sched.waiting), kv_pages_used=pool.num_used, kv_pages_total=pool.num_pages,
            ring_slots_used=0, queued_tokens=sum(r.num_tokens for r in sched.waiting),
            num_preemptions=sched.num_preemptions,
            num_encoded_images=0 if vision is None else vision.num_encoded_images, pages_integrity_ok=pool.integrity_ok(),
        ))

    def serve(self) -> None:
        """Report ready, then loop until :class:`Shutdown` or the parent process dies."""
        self.channel.send(messages.WorkerReady("colocated", self.spec.index, os.getpid(), self.engine.kv_cache.num_pages))
        running = True
        while running and self.channel.parent_alive():
            busy = self.engine.has_unfinished()
            for msg in self.channel.recv(0 if busy else IDLE_WAIT_MS):
                running = running and self._on_message(msg)
            if self.engine.has_unfinished():
                self._step()
            if time.monotonic() >= self._next_stats:
                self._next_stats = time.monotonic() + self.spec.stats_interval_s
                self._send_stats()

    def close(self) -> None:
        self.channel.close()
