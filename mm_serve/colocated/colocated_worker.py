"""The colocated worker process: one engine runs encode, prefill and decode (vLLM-style baseline).

It speaks the same protocol as the disaggregated workers (requests in, token
batches out) from the same :class:`~mm_serve.runtime.worker_shell.WorkerShell`, so
the front end, the API and the benchmarks treat both modes alike.
"""

from __future__ import annotations

import time

from mm_serve.colocated.llm_engine import LLMEngine
from mm_serve.ground.roles import Role
from mm_serve.inputs.input_processor import ProcessedInputs
from mm_serve.runtime import messages
from mm_serve.runtime.lifetime import LifetimeEvent
from mm_serve.runtime.post_step import token_update
from mm_serve.runtime.sampling_wire import from_wire
from mm_serve.runtime.step_clock import StepClock
from mm_serve.runtime.warm_up import warm_up
from mm_serve.runtime.worker_setup import cache_report
from mm_serve.runtime.worker_shell import WorkerShell


class ColocatedWorker(WorkerShell):
    """Wraps :class:`LLMEngine` in the worker shell."""

    role = Role.COLOCATED
    accepts = messages.ToPrefill

    def load(self) -> None:
        self.engine = LLMEngine(self.spec.model_dir, self.spec.sizing)
        self.kv_cache, self.model_config, self.grammars = self.engine.kv_cache, self.engine.model_config, self.engine.grammars

    def warm_up(self) -> None:
        warm_up(self.engine.runner, self.engine.max_model_len)

    def accept(self, msg: messages.PrefillRequest) -> None:
        pixels = None if msg.pixel_values is None else msg.pixel_values.to_tensor()
        inputs = ProcessedInputs(list(msg.prompt_token_ids), pixels, msg.num_images, list(msg.image_hashes),
                                 list(msg.image_token_counts), list(msg.image_tiles),
                                 [tuple(int(v) for v in size) for size in msg.image_sizes],
                                 image_second_per_grid=list(msg.image_second_per_grid), cache_salt=msg.cache_salt)
        request = self.engine.add_request(msg.request_id, inputs, from_wire(msg.sampling), msg.generator_seed,
                                          msg.output_offset, priority=msg.priority)
        request.stamp(LifetimeEvent.ARRIVED, msg.arrival_time)
        request.stamp(LifetimeEvent.PREFILL_QUEUED)

    def abort(self, request_id: str) -> None:
        request = self.engine.requests.get(request_id)
        if request is not None:
            self.engine.abort(request_id)
            self.engine.release(request_id)
            self.send([token_update(request)])

    def busy(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> None:
        if not self.engine.has_unfinished():
            return
        clock = StepClock(self.engine.grammars, self.kv_cache.data.device.type == "cpu")
        updated, finished = self.engine.step_all()
        now = time.time()
        for request in updated:
            request.stamp(LifetimeEvent.PREFILL_END, now)
        self.send([token_update(request) for request in updated], self._timing(clock))
        for request in finished:
            self.engine.release(request.request_id)

    def _timing(self, clock: StepClock) -> messages.StepTiming | None:
        """The step's timing for the front end's latency predictor: a step with prompts in it as a
        prefill step (its decode batch named: the predictor takes its price out), a decode step as its
        own time and CPU time (not the period since the last step, as a decode worker reports: between
        steps this worker takes in new requests, their images' pixels among them, which a burst of photos
        makes long, and the decode fit would learn that as the price of its batches; what running
        requests wait in all the TPOT correction learns from them); None for a step that ran nothing."""
        work = self.engine.last_step
        if work.prefill_requests:
            return clock.prefill_timing(work.prefill_requests, work.prefill_tokens, work.images,
                                        work.decode_requests, work.decode_context)
        if not work.decode_requests:
            return None
        return clock.decode_timing(work.decode_requests, work.decode_context)

    def load_report(self) -> dict[str, int]:
        sched = self.engine.scheduler
        return {
            "running": len(sched.running), "waiting": len(sched.waiting), "ring_slots_used": 0,
            "queued_tokens": sum(r.num_tokens for r in sched.waiting)
            + sum(r.num_tokens - r.num_cached_tokens for r in sched.prefilling), "num_preemptions": sched.num_preemptions,
            "num_encoded_images": self.engine.model.num_encoded_images,
            **cache_report(self.engine.prefix, self.engine.encoder_cache),
        }
