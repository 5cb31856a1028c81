"""What lengthens a colocated worker's decode step besides the forward pass, measured without a server.

Two measurements on one engine (``--threads`` torch threads, default 2, as the colocated worker runs):

* **The engine's per-step work**: ``--batch`` requests decoding together through ``LLMEngine.step_all``
  (scheduling, sampling, output) against the runner's decode pass alone at the same context; the
  difference over the batch is the engine's work per request and step (milliseconds).
* **A neighbour on the cores**: the decode pass of batch 8 and 16 at context 512 alone, and beside a
  process that spins ``busy`` ms of every ``period`` ms (10 % and 20 % of a core), mean of 60 steps;
  threads that meet at every layer wait for the one the neighbour displaced.

Usage::

    python benchmarks/colocated_step_parts.py [--model out/bench-llama] [--threads 2] [--batch 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from mm_serve.colocated.llm_engine import LLMEngine  # noqa: E402
from mm_serve.inputs.input_processor import ProcessedInputs  # noqa: E402
from mm_serve.planner.profiler import EngineProfiler  # noqa: E402
from mm_serve.runtime.engine_config import EngineConfig  # noqa: E402
from mm_serve.runtime.sampling_params import SamplingParams  # noqa: E402

NEIGHBOURS = ((0.0002, 0.002), (0.0004, 0.002), (0.0002, 0.001))  # (busy, period) seconds
PROMPT_TOKENS, STEPS = 200, 150


def _spin(busy_s: float, period_s: float, stop: multiprocessing.synchronize.Event) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < busy_s:
            pass
        time.sleep(period_s - busy_s)


def engine_work(engine: LLMEngine, batch: int) -> tuple[float, float, int]:
    """(mean seconds of ``step_all`` with ``batch`` requests decoding, seconds of the runner's decode pass
    alone at their mean context, that context in tokens per request)."""
    rng = random.Random(0)
    greedy = SamplingParams(max_tokens=STEPS + 50, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        ids = [rng.randrange(5, 1000) for _ in range(PROMPT_TOKENS)]
        engine.add_request(f"r{i}", ProcessedInputs(ids, None, 0, [], [], [], []), greedy, None, 0)
    times, contexts = [], []
    while engine.has_unfinished() and len(times) < STEPS:
        start = time.perf_counter()
        engine.step_all()
        seconds = time.perf_counter() - start
        work = engine.last_step
        if work.prefill_requests == 0 and work.decode_requests == batch:
            times.append(seconds)
            contexts.append(work.decode_context)
    for i in range(batch):
        engine.abort(f"r{i}")
        engine.release(f"r{i}")
    context = int(statistics.mean(contexts) / batch)
    return statistics.mean(times), EngineProfiler(engine, repeats=30).decode(batch, context), context


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="out/bench-llama")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="requests decoding together for the engine's work")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the neighbour measurement")
    args = parser.parse_args()
    if not Path(args.model).is_dir():
        sys.exit(f"error: no checkpoint at {args.model} (make bench-models)")
    torch.set_num_threads(args.threads)
    engine = LLMEngine(args.model, EngineConfig(num_pages=4000))
    step, alone, context = engine_work(engine, args.batch)
    print(f"engine step_all, batch {args.batch} at {context} tokens: {step * 1e3:.2f} ms; decode pass alone "
          f"{alone * 1e3:.2f} ms; engine work {(step - alone) / args.batch * 1e3:.3f} ms per request and step")
    profiler = EngineProfiler(engine, repeats=1)
    for round_ in range(1, args.rounds + 1):
        for busy, period in ((0.0, 0.0), *NEIGHBOURS):
            stop = multiprocessing.Event()
            neighbour = None
            if busy:
                neighbour = multiprocessing.Process(target=_spin, args=(busy, period, stop))
                neighbour.start()
                time.sleep(0.3)
            try:
                means = [statistics.mean(profiler.decode_steps(batch, 512, 60)) for batch in (8, 16)]
            finally:
                if neighbour is not None:
                    stop.set()
                    neighbour.join()
            label = f"{busy / period:.0%} ({busy * 1e3:.1f} ms every {period * 1e3:.0f} ms)" if busy else "none"
            print(f"round {round_}, neighbour {label:>24}: decode batch 8 {means[0] * 1e3:6.2f} ms, "
                  f"batch 16 {means[1] * 1e3:6.2f} ms (context 512, mean of 60)", flush=True)


if __name__ == "__main__":
    main()
