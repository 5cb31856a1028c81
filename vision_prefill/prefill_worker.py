"""The prefill worker process: vision encoder + projector + LLM prefill, first token, KV hand-off.

Start-up story: pin cores → load the model → size the KV cache → attach the
rings → report ready → serve. Each loop iteration: read control messages,
publish pending hand-offs, run one prefill batch if memory allows.
"""

from __future__ import annotations

import os
import time

import torch

from kernels.ring_buffer import CrossModalRing
from mm_serve import messages
from mm_serve.engine.doorbell import DoorbellRingers
from mm_serve.engine.model_runner import ModelRunner
from mm_serve.engine.request import Request, RequestStatus
from mm_serve.engine.sampling_wire import from_wire
from mm_serve.engine.worker_channel import IDLE_WAIT_MS, WorkerChannel
from mm_serve.engine.worker_setup import load_for_worker, pin_and_set_threads
from mm_serve.engine.worker_spec import WorkerSpec
from text_decode.kv_cache import pages_for
from text_decode.sampler import Sampler, make_generator, sample_requests
from text_decode.stop_checker import check_stop_token
from vision_prefill.handoff_sender import HandoffSender, generator_state
from vision_prefill.prefill_scheduler import PrefillScheduler


class PrefillWorker:
    """Runs prefill batches and hands each request's KV to its decode worker."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        pin_and_set_threads(spec)
        self.model_config, self.model, self.kv_cache, self.config = load_for_worker(spec)
        self.runner = ModelRunner(self.model, self.kv_cache)
        self.rings = [CrossModalRing.attach(r) for r in spec.rings]
        self.doorbells = DoorbellRingers(spec.doorbells)
        self.sender = HandoffSender(self.rings, self.kv_cache,
                                    self.doorbells.ring if spec.doorbells else None)
        self.scheduler = PrefillScheduler(self.config.prefill_token_budget, self.config.prefill_batch_size)
        self.sampler = Sampler()
        self.channel = WorkerChannel(spec.control_address, spec.output_address, messages.ToPrefill, spec.parent_pid)
        self.max_model_len = self.config.resolved_max_model_len(self.model_config.text)
        self._targets: dict[str, int] = {}
        self._generators: dict[str, torch.Generator | None] = {}
        self._events: dict[str, dict[str, float]] = {}
        self._next_stats = 0.0

    # ---- control ---------------------------------------------------------------------------

    def _on_message(self, msg: object) -> bool:
        """Handle one control message; returns False on shutdown."""
        if isinstance(msg, messages.PrefillRequest):
            self._enqueue(msg)
        elif isinstance(msg, messages.AbortRequest):
            self._abort(msg.request_id)
        elif isinstance(msg, messages.StatsQuery):
            self._send_stats()
        elif isinstance(msg, messages.Shutdown):
            return False
        return True

    def _enqueue(self, msg: messages.PrefillRequest) -> None:
        params = from_wire(msg.sampling)
        pixels = None if msg.pixel_values is None else msg.pixel_values.to_tensor()
        request = Request(msg.request_id, list(msg.prompt_token_ids), params, num_images=msg.num_images,
                          pixel_values=pixels)
        self._targets[msg.request_id] = msg.decode_index
        self._generators[msg.request_id] = None if params.greedy else make_generator(msg.generator_seed)
        self._events[msg.request_id] = {"arrived": msg.arrival_time, "prefill_queued": time.time()}
        self.scheduler.add(request)

    def _abort(self, request_id: str) -> None:
        if self.scheduler.remove(request_id) is None:
            self.sender.abort(request_id)
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._targets.pop(request_id, None)
        self._generators.pop(request_id, None)
        self._events.pop(request_id, None)

    # ---- prefill ---------------------------------------------------------------------------

    def _fits(self, batch: list[Request]) -> bool:
        need = sum(pages_for(r.num_tokens, self.config.page_size) for r in batch)
        return self.kv_cache.pool.can_allocate(need)

    def _run_batch(self, batch: list[Request]) -> None:
        for request in batch:
            request.block_table = self.kv_cache.pool.allocate(pages_for(request.num_tokens, self.config.page_size))
            request.status = RequestStatus.RUNNING
        now = time.time()
        for request in batch:
            self._events[request.request_id]["encode_begin"] = now
        self.runner.encode_images(batch)
        now = time.time()
        for request in batch:
            self._events[request.request_id].update(encode_end=now, prefill_begin=now)
        logits = self.runner.prefill(batch)
        tokens, logprobs = sample_requests(self.sampler, logits, batch, self._generators)
        done = time.time()
        updates = []
        for request, token, lp in zip(batch, tokens, logprobs, strict=True):
            events = self._events[request.request_id]
            events["prefill_end"] = done
            request.output_token_ids.append(token)
            status = check_stop_token(request, token, frozenset(), self.max_model_len)
            finish = None
            if status is not None:
                finish = "stop" if status == RequestStatus.FINISHED_STOPPED else "length"
                self.kv_cache.pool.free(request.block_table)
                request.block_table = []
            else:
                self.sender.add(request, self._targets[request.request_id], self._meta(request, lp, events))
            updates.append(messages.TokenUpdate(
                request.request_id, 0, [token], None if lp is None else [lp], finish,
                token if finish == "stop" else None, dict(events),
            ))
            if finish is not None:
                self._forget(request.request_id)
        self.channel.send(messages.TokenBatch("prefill", self.spec.index, updates))

    def _meta(self, request: Request, lp: dict[int, float] | None, events: dict[str, float]) -> messages.HandoffMeta:
        p = request.sampling_params
        return messages.HandoffMeta(
            prompt_token_ids=request.prompt_token_ids,
            sampling=messages.SamplingMsg(p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed,
                                          list(p.stop_token_ids), p.ignore_eos, p.logprobs),
            generator_state=generator_state(self._generators.get(request.request_id)),
            num_images=request.num_images, first_logprobs=lp, events=dict(events),
        )

    # ---- loop ------------------------------------------------------------------------------

    def _send_stats(self) -> None:
        pool = self.kv_cache.pool
        vision = self.model.vision
        self.channel.send(messages.WorkerStats(
            role="prefill", index=self.spec.index, pid=os.getpid(), running=self.sender.num_pending,
            waiting=len(self.scheduler), kv_pages_used=pool.num_used, kv_pages_total=pool.num_pages,
            ring_slots_used=self.sender.slots_used(), queued_tokens=self.scheduler.queued_tokens,
            num_preemptions=0, num_encoded_images=0 if vision is None else vision.num_encoded_images,
            pages_integrity_ok=pool.integrity_ok(),
        ))

    def serve(self) -> None:
        """Report ready, then loop until :class:`Shutdown` or the parent process dies."""
        self.channel.send(messages.WorkerReady("prefill", self.spec.index, os.getpid(), self.kv_cache.num_pages))
        running = True
        while running and self.channel.parent_alive():
            busy = bool(self.scheduler.queue or self.sender.pending)
            for msg in self.channel.recv(0 if busy else IDLE_WAIT_MS):
                running = running and self._on_message(msg)
            for request in self.sender.pump():
                self._forget(request.request_id)
            if not self.sender.pending:
                batch = self.scheduler.next_batch(self._fits)
                if batch:
                    self._run_batch(batch)
            elif busy:
                time.sleep(0.0005)
            if time.monotonic() >= self._next_stats:
                self._next_stats = time.monotonic() + self.spec.stats_interval_s
                self._send_stats()

    def close(self) -> None:
        for ring in self.rings:
            ring.close()
        self.doorbells.close()
        self.channel.close()
