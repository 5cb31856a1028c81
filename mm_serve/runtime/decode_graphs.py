"""Decode steps replayed from CUDA graphs: one launch per step instead of hundreds.

A decode step of a small or mid-size model on a GPU is bound by kernel launches
and Python, not by the GPU (eager decode steps of the bench model took milliseconds on an H200
where the arithmetic needs well under one: benchmarks/results/2026-11-29-gpu-h200.md). As vLLM and SGLang do, the step is captured once per shape in a
``torch.cuda.CUDAGraph`` and replayed with new contents. Shapes are bucketed: the
batch is padded up to the next of :data:`BATCH_BUCKETS` and the block tables up to
the next power of two pages, so a handful of graphs serve every step. Padded rows
feed token 0 at position 0 with one token of context on the cache's
``scratch_page``, where their K/V writes land harmlessly; their logits are dropped.

Attention inside a captured step is :func:`mm_serve.kernels.paged_attention_ref.decode_attention_padded`
(static shapes, no host reads), selected by ``AttentionMetadata.graph_safe``.
On a CPU the same padded step runs eagerly (``capture=False``), which is how the
tests check it against the ordinary decode path; capture needs CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mm_serve.runtime.kv_cache import PagedKVCache
from mm_serve.runtime.request import Request
from mm_serve.runtime.step_inputs import decode_inputs

DecodeForward = Callable[..., torch.Tensor]  # ModelRunner.forward_decode

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
WARMUP_RUNS = 2  # eager runs on a side stream before a capture (lazy initialisation happens there)


def batch_bucket(batch: int) -> int | None:
    """The smallest bucket of :data:`BATCH_BUCKETS` holding ``batch`` rows (None when too large)."""
    return next((b for b in BATCH_BUCKETS if b >= batch), None)


def pages_bucket(pages: int) -> int:
    """``pages`` rounded up to a power of two (at least 1)."""
    return 1 << max(pages - 1, 0).bit_length()


@dataclass
class _Graph:
    """One captured step: its static inputs (written before each replay) and its logits output."""

    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # [b] int64
    positions: torch.Tensor  # [b] int64
    slot_mapping: torch.Tensor  # [b] int64
    block_tables: torch.Tensor  # [b, p] int64
    context_lens: torch.Tensor  # [b] int64
    logits: torch.Tensor  # [b, vocab] float32


class DecodeGraphs:
    """Decode steps for batches of up to ``max_batch`` requests, captured per (batch, pages) bucket.

    Args:
        forward: the decode forward pass (``ModelRunner.forward_decode``), called with
            ``graph_safe=True``.
        kv_cache: its paged cache (``scratch_page`` receives the padded rows' K/V).
        max_batch: the largest batch to capture for (larger batches run uncaptured).
        capture: capture and replay CUDA graphs (needs a CUDA cache); False runs the
            same padded step eagerly.

    Raises:
        ValueError: ``capture`` with a cache that is not on a CUDA device.
    """

    def __init__(self, forward: DecodeForward, kv_cache: PagedKVCache, max_batch: int, capture: bool) -> None:
        if capture and kv_cache.data.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA KV cache, this one is on {kv_cache.data.device}")
        self.forward = forward
        self.kv_cache = kv_cache
        self.page_size = kv_cache.page_size
        self.device = kv_cache.data.device
        self.capture = capture
        self.max_batch = batch_bucket(max_batch) or BATCH_BUCKETS[-1]
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool: Any = None  # the memory pool every graph shares (a CUDA graph pool handle)

    @property
    def num_graphs(self) -> int:
        """Graphs captured so far."""
        return len(self._graphs)

    def supports(self, requests: list[Request]) -> bool:
        """Whether :meth:`run` takes this batch (non-empty and within ``max_batch``)."""
        return 0 < len(requests) <= self.max_batch

    @torch.inference_mode()
    def run(self, requests: list[Request]) -> torch.Tensor:
        """One decode step (as ``ModelRunner.decode``): logits ``[B, vocab]`` (float32).

        Raises:
            ValueError: the batch is empty or larger than ``max_batch``.
        """
        if not self.supports(requests):
            raise ValueError(f"a captured decode step takes 1 to {self.max_batch} requests, got {len(requests)}")
        n = len(requests)
        batch = batch_bucket(n) or n
        pages = pages_bucket(max(len(r.block_table) for r in requests))
        inputs = [
            torch.tensor(x, dtype=torch.long)
            for x in decode_inputs(requests, self.page_size, batch, pages, self.kv_cache.scratch_page)
        ]
        if not self.capture:
            return self._forward(*(t.to(self.device) for t in inputs))[:n]
        graph = self._graphs.get((batch, pages)) or self._capture(batch, pages)
        for static, value in zip(
            (graph.input_ids, graph.positions, graph.slot_mapping, graph.block_tables, graph.context_lens), inputs,
            strict=True,
        ):
            static.copy_(value, non_blocking=True)
        graph.graph.replay()
        return graph.logits[:n].clone()

    def _forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.forward(*inputs, graph_safe=True)

    def _capture(self, batch: int, pages: int) -> _Graph:
        """Capture the step for ``batch`` rows and ``pages`` pages per row (inputs: padding rows)."""
        ids, positions, slots, tables, context = (
            torch.tensor(x, dtype=torch.long, device=self.device)
            for x in decode_inputs([], self.page_size, batch, pages, self.kv_cache.scratch_page)
        )
        static = (ids, positions, slots, tables, context)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._forward(*static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(*static)
        if self._pool is None:
            self._pool = graph.pool()
        captured = _Graph(graph, ids, positions, slots, tables, context, logits)
        self._graphs[(batch, pages)] = captured
        return captured
