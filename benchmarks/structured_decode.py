"""What grammar-constrained decoding costs: decode tokens/s of a batch with and without a JSON schema, on the
same model, threads and prompts, in one run.

Decode tokens/s = (output tokens of the batch - one per request) / (wall time of the whole generation - wall
time of a one-token generation of the same batch), as ``decode_throughput.py`` takes it. The schema is an
array of 40 integers, so every request decodes ~100-200 tokens under the grammar's mask; the free run decodes
``--new-tokens`` per request with EOS ignored.

    python benchmarks/structured_decode.py [--model bench] [--batch 32] [--threads 2] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from mm_serve import LLM, SamplingParams  # noqa: E402
from mm_serve.bench.llama_checkpoints import llama_checkpoint  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99999}, "minItems": 40,
          "maxItems": 40}


def _rate(llm: LLM, prompts: list[dict], params: list[SamplingParams], repeats: int) -> tuple[float, int]:
    """(decode tokens/s, output tokens) of generating ``params`` for ``prompts`` (best of ``repeats``)."""
    one = [replace(p, max_tokens=1) for p in params]
    best, tokens = 0.0, 0
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        full = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate(prompts, one, use_tqdm=False)
        first = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outputs)
        best = max(best, (tokens - len(prompts)) / max(full - first, 1e-9))
    return best, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench", help="bench (8 layers, hidden 512), tiny, or a checkpoint dir")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per request of the free run")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(model=llama_checkpoint(args.model), mode="colocated", num_pages=2048, max_running=64)
    prompts = [{"prompt": f"list {i} numbers:"} for i in range(args.batch)]
    free = [SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=i, ignore_eos=True)
            for i in range(args.batch)]
    grammar = [SamplingParams(max_tokens=400, temperature=1.0, seed=i, structured=("json", json.dumps(SCHEMA)))
               for i in range(args.batch)]
    llm.generate(prompts[:2], grammar[:2], use_tqdm=False)  # warm-up: the compiler and its cache
    free_rate, free_tokens = _rate(llm, prompts, free, args.repeats)
    grammar_rate, grammar_tokens = _rate(llm, prompts, grammar, args.repeats)
    print(f"model {args.model} | batch {args.batch} | threads {args.threads}")
    print(f"{'':>22} | {'decode tok/s':>12} | output tokens")
    print(f"{'free':>22} | {free_rate:>12.1f} | {free_tokens}")
    print(f"{'JSON schema (40 ints)':>22} | {grammar_rate:>12.1f} | {grammar_tokens}")
    print(f"constrained / free: {grammar_rate / free_rate:.2f}x ({(1 - grammar_rate / free_rate) * 100:.1f} % slower)")


if __name__ == "__main__":
    main()
