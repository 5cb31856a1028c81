"""The prefill worker process: vision encoder + projector + LLM prefill, first token, KV hand-off.

Runs in the :class:`~mm_serve.runtime.worker_shell.WorkerShell`. Each step: publish
pending hand-offs, then, when none is left waiting for ring room, run one prefill
batch that fits the KV cache. A request longer than ``prefill_chunk_tokens`` is
prefilled one chunk per step (its pages are allocated at the first chunk); only its
last chunk samples the first token and hands it off.
"""

from __future__ import annotations

import time

from mm_serve.ground.roles import Role
from mm_serve.runtime import messages
from mm_serve.runtime.lifetime import LifetimeEvent
from mm_serve.runtime.model_runner import ModelRunner
from mm_serve.runtime.page_hashes import image_content_hashes, salted
from mm_serve.runtime.post_step import StopCriteria, process_step, token_update
from mm_serve.runtime.request import Request, RequestStatus
from mm_serve.runtime.sampler import Sampler, make_generator, sample_requests
from mm_serve.runtime.sampling_wire import from_wire
from mm_serve.runtime.step_clock import StepClock
from mm_serve.runtime.structured_output import GrammarBook
from mm_serve.runtime.warm_up import warm_up
from mm_serve.runtime.worker_setup import cache_report, load_for_worker, make_caches
from mm_serve.runtime.worker_shell import WorkerShell
from mm_serve.transport.doorbell import DoorbellRingers
from mm_serve.transport.registry import ring_opener
from mm_serve.vision_prefill.handoff_sender import HandoffSender
from mm_serve.vision_prefill.prefill_scheduler import PrefillScheduler

BACKPRESSURE_SLEEP_S = 0.0005  # hand-offs wait for ring room: yield the core between tries


class PrefillWorker(WorkerShell):
    """Runs prefill batches and hands each request's KV to its decode worker."""

    role = Role.PREFILL
    accepts = messages.ToPrefill

    def load(self) -> None:
        spec = self.spec
        self.model_config, cfg, self.model, self.kv_cache = load_for_worker(spec)
        self.prefix, self.encoder_cache = make_caches(spec.model_dir, self.model_config, cfg, self.kv_cache)
        self.runner = ModelRunner(self.model, self.kv_cache, encoder_cache=self.encoder_cache)
        open_ring = ring_opener(self.link, "producer")
        self.rings = [open_ring(r) for r in spec.rings]
        self.doorbells = DoorbellRingers(spec.doorbells)
        self.sender = HandoffSender(self.rings, self.kv_cache, self.doorbells.ring if spec.doorbells else None,
                                    checksum=spec.handoff_checksum, release=self.prefix.release, open_ring=open_ring)
        self.scheduler = PrefillScheduler(cfg.prefill_token_budget, cfg.prefill_batch_size,
                                          chunk_tokens=cfg.prefill_chunk_tokens)
        self.sampler = Sampler()
        self.grammars = GrammarBook(spec.model_dir)  # EOS: in each request's stop tokens
        # EOS is folded into each request's stop tokens by the front end (sampling_wire)
        self.stops = StopCriteria(frozenset(), cfg.context_limit(self.model_config.text))

    def warm_up(self) -> None:
        warm_up(self.runner, self.stops.max_model_len, decode=False)

    # ---- requests ----------------------------------------------------------------------------

    def accept(self, msg: messages.PrefillRequest) -> None:
        params = from_wire(msg.sampling)
        pixels = None if msg.pixel_values is None else msg.pixel_values.to_tensor()
        request = Request(
            msg.request_id, list(msg.prompt_token_ids), params, num_images=msg.num_images, pixel_values=pixels,
            image_token_counts=list(msg.image_token_counts), image_tiles=list(msg.image_tiles),
            image_sizes=[tuple(int(v) for v in size) for size in msg.image_sizes],
            image_second_per_grid=list(msg.image_second_per_grid),
            cache_salt=msg.cache_salt,
            image_hashes=list(msg.image_hashes) or [salted(h, msg.cache_salt) for h in image_content_hashes(
                pixels, msg.image_tiles, msg.image_sizes, msg.image_second_per_grid)],
            generator=None if params.greedy else make_generator(msg.generator_seed),
            seed=None if params.greedy else msg.generator_seed, output_offset=msg.output_offset,
            decode_index=msg.decode_index, priority=msg.priority, max_wait_s=msg.max_wait_s,
        )
        request.stamp(LifetimeEvent.ARRIVED, msg.arrival_time)
        request.stamp(LifetimeEvent.PREFILL_QUEUED)
        self.grammars.prefetch(request, self.model_config.text.vocab_size)  # compiled while it queues and prefills
        self.scheduler.add(request)

    def abort(self, request_id: str) -> None:
        queued = self.scheduler.remove(request_id)
        if queued is None:
            self.sender.abort(request_id)
        elif queued.block_table:  # a chunked prefill under way holds its pages
            self._release(queued, RequestStatus.FINISHED_ABORTED)

    def replace_ring(self, msg: messages.ReplaceRing) -> None:
        self.sender.replace_ring(msg.peer_index, msg.ring)

    def _release(self, request: Request, status: RequestStatus) -> None:
        """Finish a request that ended at its first token: its pages go back to the pool."""
        request.status = status
        self.prefix.release(request)

    # ---- one step ----------------------------------------------------------------------------

    def busy(self) -> bool:
        return bool(self.scheduler.queue or self.sender.pending)

    def step(self) -> None:
        busy = self.busy()
        self.sender.pump()
        for request, reason in self.sender.failed:
            print(f"[prefill {self.spec.index}] {request.request_id!r}: {reason}", flush=True)
            self.channel.send(messages.RequestFailed(request.request_id, reason))
        self.sender.failed.clear()
        if not self.sender.pending:
            batch = self.scheduler.next_batch(self._fits)
            if batch:
                self._run_batch(batch)
        elif busy:
            time.sleep(BACKPRESSURE_SLEEP_S)

    def _fits(self, batch: list[Request]) -> bool:
        """Whether the pool holds the pages of the batch's requests that have none yet (a chunked
        prefill under way has all of its pages)."""
        return self.kv_cache.pool.can_allocate(sum(self.prefix.pages_needed(r) for r in batch if not r.block_table))

    def _run_batch(self, batch: list[Request]) -> None:
        """Run one prefill batch; an exception fails the batch's requests, not the worker."""
        try:
            self._prefill(batch)
        except Exception as exc:  # one bad batch must not take the worker (and every other request) down
            print(f"[prefill {self.spec.index}] batch of {len(batch)} failed: {exc!r}", flush=True)
            for request in batch:
                self.sender.abort(request.request_id)
                self.scheduler.remove(request.request_id)
                if request.block_table:
                    self._release(request, RequestStatus.FINISHED_ABORTED)
                self.channel.send(messages.RequestFailed(request.request_id, f"prefill failed: {exc}"))

    def _prefill(self, batch: list[Request]) -> None:
        clock = StepClock(self.grammars, self.kv_cache.data.device.type == "cpu")
        self.channel.send(messages.PrefillStarted(self.role, self.spec.index, [r.request_id for r in batch]))
        vision = self.model.vision  # the work done is priced in tower passes (a tiled image makes several)
        encoded_before = 0 if vision is None else vision.num_encoded_tiles
        for request in batch:
            if not request.block_table:  # its first pass: cached prefix pages shared, fresh pages for the rest
                self.prefix.allocate(request)
                if request.prefill_end:
                    self.scheduler.set_chunk(request)  # the chunk starts after the cached prefix
                request.status = RequestStatus.RUNNING
                request.stamp(LifetimeEvent.ENCODE_BEGIN)
        self.runner.encode_images(batch)
        now = time.time()
        for request in batch:
            request.stamp(LifetimeEvent.ENCODE_END, now)
            request.stamp(LifetimeEvent.PREFILL_BEGIN, now)
        computed = sum((r.prefill_end or r.num_tokens) - r.num_cached_tokens for r in batch)
        logits = self.runner.prefill(batch)
        done = [i for i, r in enumerate(batch) if r.prefill_done]
        partial = [r for r in batch if not r.prefill_done]
        for request in batch:  # the KV computed is in place: later requests (and chunks) may share it
            self.prefix.commit(request, request.prefill_end or request.num_tokens)
        ready = [batch[i] for i in done]
        tokens, logprobs = sample_requests(self.sampler, logits[done], ready, grammars=self.grammars) if ready else ([], [])
        now = time.time()
        for request in ready:
            request.stamp(LifetimeEvent.PREFILL_END, now)
        finished = process_step(ready, tokens, logprobs, self.stops, self._release)
        for request in ready:
            if request not in finished:
                self.sender.add(request)
        for request in reversed(partial):  # the next chunk starts where this one ended
            request.end_chunk()
            self.scheduler.add_front(request)
        # the work done, for the latency fit: tokens computed (not the cached prefix), images encoded
        encoded = 0 if vision is None else vision.num_encoded_tiles - encoded_before
        timing = clock.prefill_timing(len(batch), computed, encoded)
        self.send([token_update(request, with_events=True) for request in ready], timing)

    # ---- stats and close ---------------------------------------------------------------------

    def load_report(self) -> dict[str, int]:
        return {
            "running": self.sender.num_pending, "waiting": len(self.scheduler),
            "ring_slots_used": self.sender.slots_used(), "queued_tokens": self.scheduler.queued_tokens,
            "num_preemptions": 0, "num_encoded_images": self.model.num_encoded_images,
            "ring_pages_held": sum(r.spec.num_pages - r.pages_free() for r in self.sender.rings),
            **cache_report(self.prefix, self.encoder_cache),
        }

    def release_resources(self) -> None:
        for ring in self.rings:
            ring.close()
        self.doorbells.close()
