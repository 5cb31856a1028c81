"""Does a prefill pass take longer when the worker idled before it? On the engine alone (no server).

Times one prompt's prefill pass (``ModelRunner.prefill``) back to back, and again after sleeping
``--idle`` seconds before each, ``--repeats`` times each, for ``--rounds`` rounds, and prints the
medians side by side (milliseconds). A colocated worker's step log showed lone prefills 1.44× their
profiled time (``benchmarks/results/2026-12-08-code-planner.md``); the profile times passes back to back.
Usage::

    python benchmarks/idle_prefill.py [--model out/bench-llama] [--threads 2] [--tokens 120] [--idle 0.3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from mm_serve.colocated.llm_engine import LLMEngine  # noqa: E402
from mm_serve.runtime.engine_config import EngineConfig  # noqa: E402
from mm_serve.runtime.warm_up import free_scratch, scratch_requests  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="out/bench-llama")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=120, help="prompt tokens")
    parser.add_argument("--idle", type=float, default=0.3, help="seconds asleep before each idle pass")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(args.model, EngineConfig(num_pages=args.tokens // 16 + 64, dtype="float32"))
    rng, vocab = random.Random(0), engine.model_config.text.vocab_size

    def one_pass() -> float:
        requests = scratch_requests(engine.kv_cache.pool, engine.config.page_size, vocab, 1, args.tokens, rng)
        try:
            start = time.perf_counter()
            engine.runner.prefill(requests)
            return time.perf_counter() - start
        finally:
            free_scratch(engine.kv_cache.pool, requests)

    one_pass(), one_pass()  # warm-up
    for k in range(1, args.rounds + 1):
        back = [one_pass() for _ in range(args.repeats)]
        idle = []
        for _ in range(args.repeats):
            time.sleep(args.idle)
            idle.append(one_pass())
        print(f"round {k}: {args.tokens} tokens on {args.threads} threads, back to back "
              f"{1e3 * statistics.median(back):.1f} ms, after {args.idle:g} s idle {1e3 * statistics.median(idle):.1f} ms",
              flush=True)


if __name__ == "__main__":
    main()
