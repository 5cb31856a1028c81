"""Colocated mode with and without mixed steps under a burst of long prompts (engine level, no HTTP).

``running`` requests (short prompts, long answers) are decoding when ``burst`` long prompts
arrive at once. Each system then steps its engine until every request is done. Reported per
system, median [range] over ``--rounds`` rounds run alternately:

- the decoding requests' TPOT over the burst (each one's time from the burst's arrival to its last
  token over the tokens it made in that time: DistServe's per-request TPOT, restricted to the part of
  its life the burst can slow; the largest of them, ms);
- their inter-token gaps from the burst's arrival on (p50, p99, max, ms): a
  whole-prompt prefill step stalls every running request for the burst's prefill time, a mixed
  step (``mixed_step_tokens``) for one budget-sized step;
- the burst's TTFT (p50 and max, s, from the moment it arrived);
- the wall time until every request finished (s), and output tokens/s over it.

Usage: ``python benchmarks/mixed_steps.py [--model bench|DIR] [--threads 2] [--budget 256] [--running 8]
[--burst 4] [--burst-len 1600] [--running-tokens 200] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from mm_serve import LLM, SamplingParams  # noqa: E402
from mm_serve.bench.llama_checkpoints import llama_checkpoint  # noqa: E402


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _run(llm: LLM, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """One round on ``llm``'s engine: the running requests reach decode, the burst arrives, all drain."""
    engine = llm.engine
    rng = random.Random(seed)
    vocab = engine.model_config.text.vocab_size

    def add(tag: str, length: int, max_tokens: int) -> str:
        request_id = f"{tag}-{seed}-{rng.getrandbits(32)}"
        inputs = engine.inputs.process({"prompt_token_ids": [rng.randrange(5, vocab) for _ in range(length)]})
        engine.add_request(request_id, inputs, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return request_id

    running = [add("run", 64, args.running_tokens) for _ in range(args.running)]
    while any(not engine.requests[r].output_token_ids for r in running):  # every running request decodes
        engine.step_all()
    start = time.perf_counter()
    burst = {add("burst", args.burst_len, 16): 0.0 for _ in range(args.burst)}
    last = dict.fromkeys(running, start)
    gaps: list[float] = []
    per_request: dict[str, list[float]] = {r: [] for r in running}
    tokens = 0
    while engine.has_unfinished():
        updated, finished = engine.step_all()
        now = time.perf_counter()
        for request in updated:
            tokens += 1
            if request.request_id in last:
                gaps.append(now - last[request.request_id])
                per_request[request.request_id].append(now - last[request.request_id])
                last[request.request_id] = now
            elif request.request_id in burst and not burst[request.request_id]:
                burst[request.request_id] = now - start
        for request in finished:
            engine.release(request.request_id)
    wall = time.perf_counter() - start
    ttfts = list(burst.values())
    tpots = [statistics.fmean(g) for g in per_request.values() if g]
    return {
        "TPOT max ms": 1e3 * max(tpots),
        "gap p50 ms": 1e3 * statistics.median(gaps), "gap p99 ms": 1e3 * _percentile(gaps, 0.99),
        "gap max ms": 1e3 * max(gaps), "burst TTFT p50 s": statistics.median(ttfts), "burst TTFT max s": max(ttfts),
        "drain s": wall, "tokens/s": tokens / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench", help="bench (8 layers, hidden 512), tiny, or a Llama checkpoint dir")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", type=int, default=256, help="mixed_step_tokens of the mixed system")
    parser.add_argument("--running", type=int, default=8, help="requests decoding when the burst arrives")
    parser.add_argument("--running-tokens", type=int, default=200, help="output tokens of each running request")
    parser.add_argument("--burst", type=int, default=4, help="long prompts arriving at once")
    parser.add_argument("--burst-len", type=int, default=1600, help="tokens of each long prompt")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = llama_checkpoint(args.model)
    systems = {
        f"mixed steps ({args.budget} tokens)": LLM(model=model_dir, mode="colocated", num_pages=2048,
                                                   mixed_step_tokens=args.budget),
        "prefill and decode steps apart": LLM(model=model_dir, mode="colocated", num_pages=2048, mixed_step_tokens=0),
    }
    print(f"model {model_dir} | threads {args.threads} | {args.running} decoding (64-token prompts, "
          f"{args.running_tokens} tokens) | burst of {args.burst} x {args.burst_len}-token prompts | "
          f"{args.rounds} rounds alternated")
    for llm in systems.values():
        _run(llm, argparse.Namespace(**{**vars(args), "burst": 1, "burst_len": 64, "running_tokens": 4}), seed=0)  # warm-up
    results: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
    for round_ in range(args.rounds):
        for name, llm in systems.items():
            results[name].append(_run(llm, args, seed=round_ + 1))
    columns = list(next(iter(results.values()))[0])
    print("| system | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, rounds in results.items():
        cells = []
        for column in columns:
            values = [r[column] for r in rounds]
            cells.append(f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
