"""How long a worker's step took, as the front end's latency predictor reads it.

A prefill step (the prefill worker's batch, the colocated worker's step with prompts in it), and a
colocated worker's decode step, is timed by wall clock and, on a CPU, by the worker's own CPU seconds per torch thread, which time
slices taken by other processes on its cores do not inflate. Structured-output setup inside the
step (importing xgrammar, building a compiler or a matcher: :attr:`GrammarBook.setup_s`) is no
model work: it is taken out of the wall time, and a step that had more than
:data:`GRAMMAR_SETUP_IGNORED_S` of it reports no CPU time (a compile's own threads count in the
process's CPU time).
"""

from __future__ import annotations

import time

import torch

from mm_serve.runtime import messages
from mm_serve.runtime.structured_output import GrammarBook

GRAMMAR_SETUP_IGNORED_S = 0.001  # a step with more structured-output setup reports no CPU time


class StepClock:
    """Started where a step begins (construct it there); :meth:`prefill_timing` or :meth:`decode_timing`
    where it ends (a decode worker, which reports its step's period, takes only :meth:`setup_s`)."""

    def __init__(self, grammars: GrammarBook, cpu: bool) -> None:
        """``cpu``: the worker computes on the CPU (its CPU time is measured; a GPU's is not)."""
        self.grammars, self.cpu = grammars, cpu
        self.started, self.cpu_started = time.monotonic(), time.process_time()
        self.setup_started = grammars.setup_s

    def setup_s(self) -> float:
        """Seconds of structured-output setup since the clock started."""
        return self.grammars.setup_s - self.setup_started

    def prefill_timing(self, requests: int, tokens: int, images: int, decode_requests: int = 0,
                       decode_context: int = 0) -> messages.StepTiming:
        """The step's :class:`~mm_serve.runtime.messages.StepTiming` ("prefill"), from the start to now.

        Args:
            requests: requests prefilled (a chunk counts its request).
            tokens: prompt tokens computed (image tokens included, a cached prefix not).
            images: vision-tower passes (images, or tiles of a tiling family's images).
            decode_requests: a colocated step's decode batch, run in the same pass (0: none).
            decode_context: that batch's context tokens.
        """
        seconds, cpu = self._times()
        return messages.StepTiming("prefill", seconds, requests, tokens, images, cpu, decode_requests, decode_context)

    def decode_timing(self, requests: int, context: int) -> messages.StepTiming:
        """A decode-only step's :class:`~mm_serve.runtime.messages.StepTiming` ("decode") from the start to
        now, with its CPU seconds per thread (a colocated worker's: its steps slow down while the API process
        decodes photos on the same cores, which the predictor's per-worker scale follows, not its fit)."""
        seconds, cpu = self._times()
        return messages.StepTiming("decode", seconds, requests, context, 0, cpu)

    def _times(self) -> tuple[float, float]:
        """(wall seconds less the structured-output setup, CPU seconds per thread or 0.0) since the start."""
        setup = self.setup_s()
        cpu = 0.0
        if self.cpu and setup <= GRAMMAR_SETUP_IGNORED_S:
            cpu = (time.process_time() - self.cpu_started) / torch.get_num_threads()
        return max(0.0, time.monotonic() - self.started - setup), cpu
