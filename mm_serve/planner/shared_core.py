"""A CPU placement where the decode worker shares a core with a prefill worker.

On ``n`` cores, ``n`` prefill workers (one a core) and one decode worker on the last core, beside the
prefill worker there. Two rules split that core (what ``configs/summarization.yaml`` set by hand):

* **Niceness.** The prefill worker on the shared core runs :data:`SHARED_NICE_STEP` nice levels above
  the decode worker. Linux CFS gives runnable tasks CPU in proportion to their weights, ``1024 /
  1.25 ** nice`` (``sched_prio_to_weight`` in the kernel's ``kernel/sched/core.c``), so when both
  want the core the decode worker gets ``share`` = 0.75 of it (:func:`cfs_share`). Five levels, not
  more: the prefill worker also yields to the front end and to the client, which already made TTFT the
  bound at twelve levels (``benchmarks/results/2026-12-04-summarization-paced.md``).
* **Pacing.** The decode worker starts a step at most every ``pacing`` × the TPOT SLO (``I`` seconds;
  ``scheduler.decode_step_pacing``: :mod:`mm_serve.runtime.pacing`) and sleeps out the rest. The
  planner tries each of :data:`PACINGS` (0: unpaced) and keeps the best.

The model of the shared core, for a decode step of ``d`` seconds of work alone (its
:class:`~mm_serve.planner.latency_model.DecodeTiming`) while the prefill worker is busy:

* the step takes ``d / share`` seconds, and a step starts every ``max(I, d / share)`` seconds
  (:class:`PacedDecodeTiming`);
* the prefill worker gets a fraction ``max(1 - share, 1 - d / I)`` of the core (``1 - share`` when
  unpaced): per interval the decode worker uses ``d`` seconds of the core, the prefill worker the rest,
  and when the steps run back to back CFS splits the core by weight. A prefill batch on that core
  takes its time alone divided by that fraction, for the running batch at its start
  (:func:`prefill_slowdown`).

Both are pessimistic when the other side idles (the prefill worker waits for prompts, or no request
is decoding): then each runs alone at full speed.
"""

from __future__ import annotations

from dataclasses import dataclass

from mm_serve.planner.latency_model import DecodeTiming

SHARED_NICE_STEP = 5  # the prefill worker on the decode worker's core: this many nice levels above it
PACINGS = (0.0, 0.5, 0.7, 0.9)  # decode step pacing tried (fractions of the TPOT SLO; 0 = unpaced)
MIN_PREFILL_FRACTION = 0.05  # the least of the shared core a busy prefill worker is priced with


def cfs_weight(nice: int) -> float:
    """Linux CFS weight of a task at ``nice`` (-20..19): ``1024 / 1.25 ** nice``, the kernel's
    ``sched_prio_to_weight`` table to within 1 %."""
    return 1024.0 / 1.25 ** nice


def cfs_share(decode_nice: int, prefill_nice: int) -> float:
    """The decode worker's share (0-1) of a core that it and the prefill worker both want."""
    decode, prefill = cfs_weight(decode_nice), cfs_weight(prefill_nice)
    return decode / (decode + prefill)


@dataclass(frozen=True)
class PacedDecodeTiming(DecodeTiming):
    """A decode instance on a shared core: each step takes ``max(interval_s, d / share)`` seconds,
    ``d`` being :class:`DecodeTiming`'s step alone (``interval_s`` 0: unpaced, ``d / share``)."""

    interval_s: float = 0.0
    share: float = 1.0

    def alone(self, batch: int, context: float) -> float:
        """The step's seconds of work, as on a core of its own (:meth:`DecodeTiming.step_time`)."""
        return super().step_time(batch, context)

    def step_time(self, batch: int, context: float) -> float:
        return self.step_ends(0.0, batch, context, 1)[0]

    def step_ends(self, start: float, batch: int, context: float, steps: int) -> list[float]:
        ends, t = [], start
        raw = super().step_ends(0.0, batch, context, steps)
        before = 0.0
        for end in raw:
            t += max(self.interval_s, (end - before) / self.share)
            before = end
            ends.append(t)
        return ends

    def min_step_time(self, context: float) -> float:
        return max(self.interval_s, super().min_step_time(context))


def prefill_slowdown(timing: PacedDecodeTiming, batch: int, context: float) -> float:
    """How many times longer a prefill batch on the shared core takes than alone, while the decode
    worker runs ``batch`` requests holding ``context`` KV tokens (1.0 when it runs none)."""
    if batch == 0:
        return 1.0
    fraction = 1.0 - timing.share
    if timing.interval_s > 0:
        fraction = max(fraction, 1.0 - timing.alone(batch, context) / timing.interval_s)
    return 1.0 / max(MIN_PREFILL_FRACTION, fraction)


@dataclass(frozen=True)
class SharedCorePlacement:
    """``cores`` prefill workers, one on each core, and one decode worker on the last core, paced at
    ``pacing`` × the TPOT SLO; the prefill worker there niced :data:`SHARED_NICE_STEP` above it."""

    cores: int
    pacing: float

    @property
    def name(self) -> str:
        paced = f"paced {self.pacing:g}" if self.pacing else "unpaced"
        return f"{self.cores}P+1D shared core ({paced})"
