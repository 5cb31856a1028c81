"""The prefill worker process: vision encoder + projector + LLM prefill, first token, KV hand-off.

Runs in the :class:`~mm_serve.runtime.worker_shell.WorkerShell`. Each step: publish
pending hand-offs, then, when none is left waiting for ring room, run one prefill
batch that fits the KV cache.
"""

from __future__ import annotations

import time

from mm_serve.runtime import messages
from mm_serve.runtime.doorbell import DoorbellRingers
from mm_serve.runtime.handoff_transport import ring_opener
from mm_serve.runtime.kv_cache import pages_for
from mm_serve.runtime.lifetime import LifetimeEvent
from mm_serve.runtime.model_runner import ModelRunner
from mm_serve.runtime.post_step import StopCriteria, process_step, token_update
from mm_serve.runtime.request import Request, RequestStatus
from mm_serve.runtime.sampler import Sampler, make_generator, sample_requests
from mm_serve.runtime.sampling_wire import from_wire
from mm_serve.runtime.worker_setup import load_for_worker
from mm_serve.runtime.worker_shell import WorkerShell
from vision_prefill.handoff_sender import HandoffSender
from vision_prefill.prefill_scheduler import PrefillScheduler

BACKPRESSURE_SLEEP_S = 0.0005  # hand-offs wait for ring room: yield the core between tries


class PrefillWorker(WorkerShell):
    """Runs prefill batches and hands each request's KV to its decode worker."""

    role = "prefill"
    accepts = messages.ToPrefill

    def load(self) -> None:
        spec, cfg = self.spec, self.spec.sizing
        self.model_config, self.model, self.kv_cache = load_for_worker(spec)
        self.runner = ModelRunner(self.model, self.kv_cache)
        open_ring = ring_opener(self.link, "producer")
        self.rings = [open_ring(r) for r in spec.rings]
        self.doorbells = DoorbellRingers(spec.doorbells)
        self.sender = HandoffSender(self.rings, self.kv_cache, self.doorbells.ring if spec.doorbells else None,
                                    checksum=spec.handoff_checksum, open_ring=open_ring)
        self.scheduler = PrefillScheduler(cfg.prefill_token_budget, cfg.prefill_batch_size)
        self.sampler = Sampler()
        # EOS is folded into each request's stop tokens by the front end (sampling_wire)
        self.stops = StopCriteria(frozenset(), cfg.context_limit(self.model_config.text))

    # ---- requests ----------------------------------------------------------------------------

    def accept(self, msg: messages.PrefillRequest) -> None:
        params = from_wire(msg.sampling)
        request = Request(
            msg.request_id, list(msg.prompt_token_ids), params, num_images=msg.num_images,
            pixel_values=None if msg.pixel_values is None else msg.pixel_values.to_tensor(),
            generator=None if params.greedy else make_generator(msg.generator_seed),
            seed=None if params.greedy else msg.generator_seed, output_offset=msg.output_offset,
            decode_index=msg.decode_index, priority=msg.priority, max_wait_s=msg.max_wait_s,
        )
        request.stamp(LifetimeEvent.ARRIVED, msg.arrival_time)
        request.stamp(LifetimeEvent.PREFILL_QUEUED)
        self.scheduler.add(request)

    def abort(self, request_id: str) -> None:
        if self.scheduler.remove(request_id) is None:
            self.sender.abort(request_id)

    def replace_ring(self, msg: messages.ReplaceRing) -> None:
        self.sender.replace_ring(msg.peer_index, msg.ring)

    def _release(self, request: Request, status: RequestStatus) -> None:
        """Finish a request that ended at its first token: its pages go back to the pool."""
        request.status = status
        self.kv_cache.pool.free(request.block_table)
        request.block_table = []

    # ---- one step ----------------------------------------------------------------------------

    def busy(self) -> bool:
        return bool(self.scheduler.queue or self.sender.pending)

    def step(self) -> None:
        busy = self.busy()
        self.sender.pump()
        if not self.sender.pending:
            batch = self.scheduler.next_batch(self._fits)
            if batch:
                self._run_batch(batch)
        elif busy:
            time.sleep(BACKPRESSURE_SLEEP_S)

    def _fits(self, batch: list[Request]) -> bool:
        need = sum(pages_for(r.num_tokens, self.kv_cache.page_size) for r in batch)
        return self.kv_cache.pool.can_allocate(need)

    def _run_batch(self, batch: list[Request]) -> None:
        """Run one prefill batch; an exception fails the batch's requests, not the worker."""
        try:
            self._prefill(batch)
        except Exception as exc:  # one bad batch must not take the worker (and every other request) down
            print(f"[prefill {self.spec.index}] batch of {len(batch)} failed: {exc!r}", flush=True)
            for request in batch:
                self.sender.abort(request.request_id)
                if request.block_table:
                    self._release(request, RequestStatus.FINISHED_ABORTED)
                self.channel.send(messages.RequestFailed(request.request_id, f"prefill failed: {exc}"))

    def _prefill(self, batch: list[Request]) -> None:
        started = time.monotonic()
        for request in batch:
            request.block_table = self.kv_cache.pool.allocate(pages_for(request.num_tokens, self.kv_cache.page_size))
            request.status = RequestStatus.RUNNING
            request.stamp(LifetimeEvent.ENCODE_BEGIN)
        self.runner.encode_images(batch)
        now = time.time()
        for request in batch:
            request.stamp(LifetimeEvent.ENCODE_END, now)
            request.stamp(LifetimeEvent.PREFILL_BEGIN, now)
        logits = self.runner.prefill(batch)
        tokens, logprobs = sample_requests(self.sampler, logits, batch)
        now = time.time()
        for request in batch:
            request.stamp(LifetimeEvent.PREFILL_END, now)
        finished = process_step(batch, tokens, logprobs, self.stops, self._release)
        for request in batch:
            if request not in finished:
                self.sender.add(request)
        timing = messages.StepTiming("prefill", time.monotonic() - started, len(batch),
                                     sum(r.num_tokens for r in batch), sum(r.num_images for r in batch))
        self.send([token_update(request, with_events=True) for request in batch], timing)

    # ---- stats and close ---------------------------------------------------------------------

    def load_report(self) -> dict[str, int]:
        vision = self.model.vision
        return {
            "running": self.sender.num_pending, "waiting": len(self.scheduler),
            "ring_slots_used": self.sender.slots_used(), "queued_tokens": self.scheduler.queued_tokens,
            "num_preemptions": 0, "num_encoded_images": 0 if vision is None else vision.num_encoded_images,
            "ring_pages_held": sum(r.spec.num_pages - r.pages_free() for r in self.sender.rings),
        }

    def release_resources(self) -> None:
        for ring in self.rings:
            ring.close()
        self.doorbells.close()
