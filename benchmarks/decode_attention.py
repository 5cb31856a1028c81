"""CPU decode attention: the compiled paged kernel against the torch reference and a streaming read.

One decode step's attention for every layer of the bench model's shape (8 layers, 8 query
heads, 4 KV heads, head_dim 64, 16-token pages; ``--layers/--heads/--kv-heads/--head-dim`` for
another, e.g. the embedded model's 4, 8, 2, 32) over a page-major :class:`PagedKVCache`
whose pages are handed out in a shuffled order, as a long-running pool's are. Prints, per
context length, milliseconds per layer of

- ``compiled``: ``torch.ops.mm_serve_cpu.paged_decode_attention`` (kernels/csrc);
- ``compiled, cache-hot``: the same call with every block-table entry pointing at one page,
  so that the K/V it reads stays in L1/L2: the kernel's arithmetic alone;
- ``reference``: :func:`mm_serve.kernels.paged_attention_ref.decode_attention_ref` (gather + SDPA);
- ``streaming read``: ``Tensor.sum`` over as many contiguous bytes, the memory bound;

and the GB/s of K/V each reaches. Cycling over all layers keeps any one layer's pages
out of the last-level cache, as in serving. One thread (as each worker runs), float32.
The cache is on transparent huge pages where Linux allows it, as a worker's is
(``mm_serve.runtime.huge_pages``); ``--small-pages`` keeps it on 4 KiB pages, to compare.

Usage::

    python benchmarks/decode_attention.py [--batch 32] [--contexts 100,400,1600] [--threads 1] [--small-pages]
        [--layers 8 --heads 8 --kv-heads 4 --head-dim 64]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mm_serve.kernels.cpu_extension import cpu_kernel_ops
from mm_serve.kernels.paged_attention_ref import decode_attention_ref
from mm_serve.runtime import kv_cache
from mm_serve.runtime.kv_cache import PagedKVCache, pages_for

PAGE = 16


@dataclass(frozen=True)
class Shape:
    """The attention shape of a model's decode step: layers, query heads, KV heads, head size."""

    layers: int = 8  # the bench model's
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 64


def _per_call_s(fn: Callable[[], object], calls: int, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def measure(batch: int, context: int, calls: int, shape: Shape = Shape()) -> dict[str, float]:
    """Seconds per layer of each path (see the module docstring) at ``batch`` sequences of ~``context`` tokens."""
    gen = torch.Generator().manual_seed(context)
    per_seq = pages_for(context, PAGE)
    cache = PagedKVCache(shape.layers, 2 * batch * per_seq, PAGE, shape.kv_heads, shape.head_dim)
    cache.data.normal_(generator=gen)
    order = torch.randperm(cache.num_pages, generator=gen)[: batch * per_seq]
    tables = order.view(batch, per_seq).contiguous()
    lens = torch.randint(max(1, context - context // 4), context + 1, (batch,), generator=gen)
    query = torch.randn(batch, shape.heads, shape.head_dim, generator=gen)
    scale = shape.head_dim**-0.5
    ops = cpu_kernel_ops()
    out: dict[str, float] = {}
    if ops is not None:
        op = ops.paged_decode_attention

        def compiled() -> None:
            for k, v in cache.layer_caches:
                op(query, k, v, tables, lens, scale)

        hot_tables = torch.zeros_like(tables)
        k0, v0 = cache.layer_caches[0]
        out["compiled"] = _per_call_s(compiled, calls) / shape.layers
        out["compiled, cache-hot"] = _per_call_s(lambda: op(query, k0, v0, hot_tables, lens, scale), calls * shape.layers)

    def reference() -> None:
        for k, v in cache.layer_caches:
            decode_attention_ref(query, k, v, tables, lens, scale)

    out["reference"] = _per_call_s(reference, max(1, calls // 4)) / shape.layers
    kv_bytes = int(lens.sum()) * shape.kv_heads * shape.head_dim * 4 * 2
    flat = cache.data.view(-1)
    span = kv_bytes // 4
    chunks = [flat[i * span:(i + 1) * span] for i in range(shape.layers)]
    out["streaming read"] = _per_call_s(lambda: [c.sum() for c in chunks], calls) / shape.layers
    out["_bytes"] = kv_bytes
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--contexts", default="100,400,1600", help="comma-separated context lengths, tokens")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=20, help="timed calls per repeat (best of 3 repeats)")
    parser.add_argument("--small-pages", action="store_true", help="leave the cache on 4 KiB pages (torch.zeros)")
    parser.add_argument("--layers", type=int, default=Shape.layers)
    parser.add_argument("--heads", type=int, default=Shape.heads, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=Shape.kv_heads)
    parser.add_argument("--head-dim", type=int, default=Shape.head_dim)
    args = parser.parse_args()
    shape = Shape(args.layers, args.heads, args.kv_heads, args.head_dim)
    torch.set_num_threads(args.threads)
    if args.small_pages:
        kv_cache.huge_page_zeros = lambda *shape, dtype: torch.zeros(*shape, dtype=dtype)
    if cpu_kernel_ops() is None:
        print("the compiled CPU kernels are not available here: only the reference is timed")
    print(f"decode attention, batch {args.batch}, {shape.layers} layers x ({shape.heads} heads, {shape.kv_heads} KV "
          f"heads, head_dim {shape.head_dim}), pages of {PAGE}, {args.threads} thread(s), "
          f"{'4 KiB' if args.small_pages else 'huge'} memory pages")
    print(f"{'context':>8} {'path':<22} {'ms/layer':>9} {'K/V GB/s':>9} {'vs compiled':>12}")
    for context in (int(c) for c in args.contexts.split(",")):
        figures = measure(args.batch, context, args.calls, shape)
        kv_bytes = figures.pop("_bytes")
        base = figures.get("compiled")
        for name, seconds in figures.items():
            ratio = f"{seconds / base:.2f}x" if base else "-"
            print(f"{context:>8} {name:<22} {seconds * 1e3:>9.3f} {kv_bytes / seconds / 1e9:>9.1f} {ratio:>12}")


if __name__ == "__main__":
    main()
