"""CPU GEMM throughput: torch's default ``F.linear`` (MKL) vs the oneDNN packed-weight path.

For the linear layers of the embedded model and of the decode benchmark's ``bench``
model, at the row counts a decode step (1-64 requests) and a prefill batch (hundreds
to thousands of tokens) produce, prints microseconds per call and GFLOP/s of both
paths, which one :class:`~mm_serve.kernels.cpu_linear.PackedLinear` picks, and the largest
relative difference of the outputs. One thread (as each worker runs), float32.

Usage::

    python benchmarks/cpu_gemm.py [--threads 1] [--iters 50]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from mm_serve.kernels.cpu_linear import PackedLinear, onednn_linear_available

# (name, in_features, out_features)
SHAPES = [
    ("embedded qkv", 256, 384),
    ("embedded gate_up", 256, 1536),
    ("embedded down", 768, 256),
    ("embedded lm_head", 256, 691),
    ("vision fc1", 192, 768),
    ("bench gate_up", 512, 2752),
    ("bench lm_head", 512, 32000),
]
ROWS = [1, 2, 4, 8, 32, 64, 256, 1152]


def _time_us(fn, iters: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not onednn_linear_available():
        raise SystemExit("this torch build has no oneDNN packed linear ops; nothing to compare")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads {args.threads}, float32; us per call (GFLOP/s); 'uses' = the path PackedLinear takes")
    print(f"{'layer':18s} {'rows':>5s} {'MKL':>18s} {'oneDNN packed':>18s} {'speed-up':>8s} {'uses':>7s} {'max rel diff':>12s}")
    with torch.inference_mode():
        for name, k, n in SHAPES:
            dense = nn.Linear(k, n, bias=False)
            packed = PackedLinear(dense)
            for m in ROWS:
                if m * k * n > 2e9:
                    continue
                x = torch.randn(m, k)
                iters = max(3, min(args.iters, int(args.iters * 2e7 / (m * k * n))))
                mkl = _time_us(lambda: F.linear(x, dense.weight), iters)  # noqa: B023
                onednn = _time_us(lambda: torch.ops.mkldnn._linear_pointwise(x, packed.packed, None, "none", [], ""), iters)  # noqa: B023
                ref = F.linear(x, dense.weight)
                got = torch.ops.mkldnn._linear_pointwise(x, packed.packed, None, "none", [], "")
                diff = float((got - ref).abs().max() / ref.abs().max())
                flop = 2 * m * k * n / 1e3  # per microsecond -> GFLOP/s
                uses = "oneDNN" if m >= packed.min_rows else "MKL"
                print(f"{name:18s} {m:5d} {mkl:9.1f} ({flop / mkl:5.1f}) {onednn:9.1f} ({flop / onednn:5.1f}) "
                      f"{mkl / onednn:7.2f}x {uses:>7s} {diff:12.1e}")


if __name__ == "__main__":
    main()
