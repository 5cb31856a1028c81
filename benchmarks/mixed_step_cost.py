"""Mixed steps' measured forward-pass time against the planner's price of them (engine level, no HTTP).

``--running`` requests (``--running-len``-token prompts) are decoding when ``--burst`` prompts of
``--burst-len`` tokens arrive; the colocated engine (``mixed_step_tokens`` = ``--budget``) then steps
until the burst's prompts are done. For every step the script prints, every ``--every``-th step, the
step's wall time, its forward pass and what the planner's colocated instance
(``mm_serve.planner.colocated_instance``) charges for it from a profile's fitted times: the chunks'
prefill pass plus the decode rows' share of a decode step. Then the sums over the mixed steps.

Usage: ``python benchmarks/mixed_step_cost.py --profile PROFILE.json [--model out/bench-llama] [--budget 128]
[--threads 2] [--running 16] [--running-len 300] [--burst 3] [--burst-len 1500] [--every 3]``
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from mm_serve import LLM, SamplingParams  # noqa: E402
from mm_serve.planner.fit import fit_profile_file  # noqa: E402
from mm_serve.planner.latency_model import LatencyModel, ParallelConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", type=Path, required=True, help="an mm-serve profile of the model on this machine")
    parser.add_argument("--model", default="out/bench-llama", help="the checkpoint folder the profile measured")
    parser.add_argument("--budget", type=int, default=128, help="mixed_step_tokens (>= 1)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the profile's degree priced)")
    parser.add_argument("--running", type=int, default=16, help="requests decoding when the burst arrives")
    parser.add_argument("--running-len", type=int, default=300, help="their prompt tokens")
    parser.add_argument("--burst", type=int, default=3, help="prompts arriving at once (>= 1)")
    parser.add_argument("--burst-len", type=int, default=1500, help="their tokens")
    parser.add_argument("--every", type=int, default=3, help="print every n-th step")
    args = parser.parse_args()
    for name in ("budget", "threads", "burst", "burst_len", "running_len", "every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.running < 0:
        parser.error("--running must be >= 0")
    if not args.profile.is_file():
        parser.error(f"no profile at {args.profile} (mm-serve profile writes one)")
    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"no checkpoint at {args.model} (make bench-models builds out/bench-llama)")
    torch.set_num_threads(args.threads)
    fit = fit_profile_file(args.profile)
    model = LatencyModel(fit.shape, fit.hardware)
    par = ParallelConfig(args.threads, 1)
    prefill, decode = model.prefill_timing(par), model.decode_timing(par)
    engine = LLM(model=args.model, mode="colocated", num_pages=2048, mixed_step_tokens=args.budget).engine
    rng = random.Random(0)
    vocab = engine.model_config.text.vocab_size

    def add(tag: str, length: int, max_tokens: int) -> None:
        inputs = engine.inputs.process({"prompt_token_ids": [rng.randrange(5, vocab) for _ in range(length)]})
        engine.add_request(f"{tag}-{rng.getrandbits(32)}", inputs,
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    for _ in range(args.running):
        add("run", args.running_len, 1000)
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step_all()
    for _ in range(args.burst):
        add("burst", args.burst_len, 8)
    runner, forward = engine.runner, engine.runner.mixed
    passes: list[tuple[float, list[tuple[int, int]], int, int]] = []

    def timed(prefill_part, decode_part):  # type: ignore[no-untyped-def]
        chunks = [(r.num_cached_tokens, r.prefill_end or r.num_tokens) for r in prefill_part]
        start = time.perf_counter()
        logits = forward(prefill_part, decode_part)
        passes.append((time.perf_counter() - start, chunks, len(decode_part), sum(r.num_tokens for r in decode_part)))
        return logits

    runner.mixed = timed  # type: ignore[method-assign]
    sums = [0.0, 0.0, 0.0]
    steps = 0
    while any(rid.startswith("burst") for rid in engine.requests):
        start = time.perf_counter()
        _, finished = engine.step_all()
        wall = time.perf_counter() - start
        for request in finished:
            engine.release(request.request_id)
        seconds, chunks, batch, context = passes[-1]
        tokens = sum(end - cached for cached, end in chunks)
        squares = sum(end * end - cached * cached for cached, end in chunks)
        priced = decode.step_time(batch, context) if batch else 0.0
        if chunks:
            priced += prefill.stage_time(tokens, squares, len(chunks), 0) - (decode.stage_const if batch else 0.0)
            sums = [sums[0] + wall, sums[1] + seconds, sums[2] + priced]
        if steps % args.every == 0:
            print(f"step {wall * 1e3:6.1f} ms, forward {seconds * 1e3:6.1f} ms, planner {priced * 1e3:6.1f} ms: "
                  f"{tokens} prefill tokens {chunks}, {batch} decodes")
        steps += 1
    ratio = f"{sums[1] / sums[2]:.2f}" if sums[2] else "-"
    print(f"mixed steps: wall {sums[0]:.3f} s, forward {sums[1]:.3f} s, planner {sums[2]:.3f} s (forward / planner {ratio})")


if __name__ == "__main__":
    main()
