"""Latency model: prefill batch time, decode step time, encode and KV hand-off times.

Every time is the additive roofline of :mod:`mm_serve.planner.hardware` applied to the
work of :mod:`mm_serve.planner.work`, adjusted for parallelism:

* **Tensor parallelism** (degree ``t``, Megatron-LM, Shoeybi et al. 2019): FLOPs,
  weight bytes and KV bytes divide by ``t``; each layer adds two ring all-reduces of
  the activations, ``2 * (latency + 2 (t-1)/t * tokens * hidden * dtype / bw_nvlink)``.
  Where the hardware profile measured instances of degree ``t`` (``Hardware.tensor_parallel``;
  on a CPU, one worker on ``t`` threads, which shares memory bandwidth and caches and does not
  scale by ``t``), their coefficients price the whole model's work instead, collectives included.
  Their per-call intercept was fitted on whole-model passes and is charged to every pipeline stage
  in full, as one device's is.
* **Pipeline parallelism** (degree ``p``, GPipe, Huang et al. 2019): a stage runs
  ``ceil(L/p)`` layers (the slowest stage, LM head included, sets the pace, so uneven
  splits are bubbles); a prefill batch takes ``p * stage + (p-1) * hop`` end to end but
  a new batch can enter every ``stage`` seconds (DistServe §3.1, inter-op: execution
  time D_m ~ D while the queue sees D_s ~ D/p). Decode splits the running batch into
  ``m = min(p, B)`` micro-batches; a step takes ``p * s0 + (p/m) * (work of B)``.

All timings are affine in their counts, so each (model, hardware, parallel config)
is reduced once to a handful of coefficients (:class:`PrefillTiming`,
:class:`DecodeTiming`) and the simulator evaluates them in O(1).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from mm_serve.planner.hardware import Hardware
from mm_serve.planner.model_shape import ModelShape
from mm_serve.planner.work import decode_work, encode_work, prefill_work


@dataclass(frozen=True, order=True)
class ParallelConfig:
    """Tensor- and pipeline-parallel degrees of one instance (it uses ``tp * pp`` GPUs)."""

    tp: int = 1
    pp: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        return f"TP{self.tp} PP{self.pp}"


@dataclass(frozen=True)
class PrefillTiming:
    """Affine prefill times of one instance (seconds).

    ``stage_time = const + per_token*T + per_token_sq*S2 + per_seq*n``
    ``+ (encode_const + per_image*I if I > 0)`` for a batch of ``n`` sequences, ``T``
    tokens in all, ``S2`` the sum of squared lengths and ``I`` images.
    """

    pp: int
    const: float
    per_token: float
    per_token_sq: float
    per_seq: float
    encode_const: float
    per_image: float
    hop_const: float
    hop_per_token: float

    def stage_time(self, tokens: float, tokens_sq: float, seqs: float, images: float) -> float:
        """Seconds between two batches entering the pipeline (the slowest stage)."""
        t = self.const + self.per_token * tokens + self.per_token_sq * tokens_sq + self.per_seq * seqs
        return t + (self.encode_const + self.per_image * images if images > 0 else 0.0)

    def latency(self, tokens: float, tokens_sq: float, seqs: float, images: float) -> float:
        """Seconds from batch start to first token (all stages plus the hops)."""
        hops = (self.pp - 1) * (self.hop_const + self.hop_per_token * tokens)
        return self.pp * self.stage_time(tokens, tokens_sq, seqs, images) + hops


@dataclass(frozen=True)
class DecodeTiming:
    """Affine decode step time of one instance: ``step_time(B, C)`` seconds."""

    pp: int
    stage_const: float
    stage_per_seq: float
    stage_per_context: float
    hop_const: float
    hop_per_seq: float

    def step_line(self, batch: int) -> tuple[float, float]:
        """``(a, b)``: a step of ``batch`` sequences holding ``C`` KV tokens in total takes ``a + b * C``
        seconds (the stage's work scaled by ``pp / m`` for ``m = min(pp, batch)`` micro-batches in
        flight, plus the constants and the ``pp - 1`` hops)."""
        pp = self.pp
        m = min(pp, max(batch, 1))
        scale = pp / m
        a = pp * self.stage_const + scale * self.stage_per_seq * batch
        if pp > 1:
            a += (pp - 1) * (self.hop_const + self.hop_per_seq * batch / m)
        return a, scale * self.stage_per_context

    def step_time(self, batch: int, context: float) -> float:
        """Seconds for every one of ``batch`` running sequences (``context`` KV tokens
        in total) to get one more token."""
        a, b = self.step_line(batch)
        return a + b * context

    def step_ends(self, start: float, batch: int, context: float, steps: int) -> list[float]:
        """End times (seconds) of ``steps`` consecutive steps of an unchanged batch
        starting at ``start``, the context growing by ``batch`` tokens a step: the same
        floats as adding :meth:`step_time` one step at a time, without a call per step."""
        a, b = self.step_line(batch)
        ends = []
        t = start
        for _ in range(steps):
            t += a + b * context
            context += batch
            ends.append(t)
        return ends

    def with_stall_per_seq(self, seconds: float) -> DecodeTiming:
        """This timing with ``seconds`` more per sequence in each step (pp 1): the CPU time that the
        front end spends on each streamed token, where it stalls the instance's step
        (:attr:`~mm_serve.planner.plan_spec.PlanSpec.front_end_s_per_token`).

        Raises:
            ValueError: ``seconds`` is negative or not finite, or the timing has pipeline stages.
        """
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"a per-sequence stall must be >= 0 seconds, got {seconds}")
        if self.pp > 1:
            raise ValueError("a per-sequence stall is modelled without pipeline stages (pp 1)")
        return dataclasses.replace(self, stage_per_seq=self.stage_per_seq + seconds)

    def min_step_time(self, context: float) -> float:
        """A lower bound (seconds) on the step of a sequence holding ``context`` KV
        tokens, in any batch: its own share of the work with the pipeline full
        (``pp / m = 1``), plus the constants. Equals ``step_time(1, context)`` for
        ``pp == 1``; with ``pp > 1`` a batch of ``m`` micro-batches can be faster per
        sequence than running it alone."""
        work = self.stage_per_seq + self.stage_per_context * context
        return self.pp * self.stage_const + work + (self.pp - 1) * self.hop_const


def _affine(fn: Callable[..., float], nargs: int) -> tuple[float, ...]:
    """Constant and slopes of an affine function of ``nargs`` arguments."""
    zero = [0.0] * nargs
    c0 = fn(*zero)
    slopes = []
    for i in range(nargs):
        x = list(zero)
        x[i] = 1.0
        slopes.append(fn(*x) - c0)
    return (c0, *slopes)


class LatencyModel:
    """Times of one model on one device kind, for any parallel configuration."""

    def __init__(self, shape: ModelShape, hardware: Hardware) -> None:
        self.shape = shape
        self.hardware = hardware

    def stage_layers(self, pp: int) -> int:
        """Decoder layers in the largest pipeline stage."""
        return math.ceil(self.shape.num_layers / pp)

    def link_bandwidth(self, cross_node: bool) -> float:
        """Per-GPU bytes/s of the link between two GPUs (NVLink or the inter-node NIC)."""
        hw = self.hardware
        return hw.inter_node_bandwidth if cross_node else hw.intra_node_bandwidth

    def _allreduce(self, tokens: float, tp: int, layers: int) -> float:
        if tp == 1:
            return 0.0
        hw = self.hardware
        msg = tokens * self.shape.hidden_size * self.shape.dtype_bytes
        one = hw.collective_latency_s + 2 * (tp - 1) / tp * msg / hw.intra_node_bandwidth
        return 2 * layers * one

    def _hop(self, cross_node: bool) -> tuple[float, float]:
        per_token = self.shape.hidden_size * self.shape.dtype_bytes / self.link_bandwidth(cross_node)
        return self.hardware.collective_latency_s, per_token

    def prefill_timing(self, par: ParallelConfig, cross_node: bool = False) -> PrefillTiming:
        """Prefill coefficients; ``cross_node`` if pipeline hops cross nodes."""
        hw, shape, tp = self.hardware, self.shape, par.tp
        layers = self.stage_layers(par.pp)

        measured = hw.tensor_parallel.get(tp) if tp > 1 else None

        def stage(tokens: float, tokens_sq: float, seqs: float) -> float:
            w = prefill_work(shape, tokens, tokens_sq, seqs, layers)
            if measured is not None:
                return measured.prefill.time(w.flops, w.bytes)
            t = hw.prefill.time(w.flops / tp, w.bytes / tp)
            return t + self._allreduce(tokens, tp, layers)

        const, per_tok, per_sq, per_seq = _affine(stage, 3)

        passes_per_image = shape.vision.tiles_per_image if shape.vision else 1

        def encode(images: float) -> float:
            w = encode_work(shape, images * passes_per_image)
            if measured is not None:
                return measured.encode.time(w.flops, w.bytes)
            return hw.encode.time(w.flops / tp, w.bytes / tp)

        enc_const, per_image = _affine(encode, 1)
        hop_const, hop_tok = self._hop(cross_node)
        return PrefillTiming(par.pp, const, per_tok, per_sq, per_seq, enc_const, per_image,
                             hop_const, hop_tok)

    def decode_timing(self, par: ParallelConfig, cross_node: bool = False,
                      front_end_s_per_token: float = 0.0) -> DecodeTiming:
        """Decode step coefficients of one pipeline stage, plus hops. An instance of tensor-parallel degree
        above 1 without pipeline stages also pays ``front_end_s_per_token`` per sequence in each step
        (:meth:`DecodeTiming.with_stall_per_seq`; the rule is the evaluator's ``decode_server``'s)."""
        hw, shape, tp = self.hardware, self.shape, par.tp
        layers = self.stage_layers(par.pp)

        measured = hw.tensor_parallel.get(tp) if tp > 1 else None

        def stage(batch: float, context: float) -> float:
            w = decode_work(shape, batch, context, layers)
            if measured is not None:
                return measured.decode.time(w.flops, w.bytes)
            return hw.decode.time(w.flops / tp, w.bytes / tp) + self._allreduce(batch, tp, layers)

        const, per_seq, per_ctx = _affine(stage, 2)
        hop_const, hop_tok = self._hop(cross_node)
        timing = DecodeTiming(par.pp, const, per_seq, per_ctx, hop_const, hop_tok)
        if par.tp > 1 and par.pp == 1 and front_end_s_per_token > 0:
            timing = timing.with_stall_per_seq(front_end_s_per_token)
        return timing

    def kv_transfer_time(self, tokens: int, streams: int, cross_node: bool) -> float:
        """Seconds to move ``tokens`` tokens of KV cache from a prefill to a decode
        instance over ``streams`` parallel GPU pairs (DistServe §4.3)."""
        size = tokens * self.shape.kv_bytes_per_token
        bw = self.link_bandwidth(cross_node) * max(1, streams)
        return self.hardware.collective_latency_s + size / bw
