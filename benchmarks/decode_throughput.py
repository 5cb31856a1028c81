"""Decode throughput: our runner vs transformers' ``generate`` on the same model and threads.

Decode tokens/s is measured the same way for both: the wall time to generate
``N`` tokens minus the wall time to generate 1 token (the prefill), divided into
the ``batch * (N - 1)`` decode tokens. Prompts have mixed lengths (32-128
tokens); transformers pads them (left), our engine batches them unpadded.

Usage: ``python benchmarks/decode_throughput.py [--model bench|tiny|large|DIR] [--threads 2] [--new-tokens 64]
[--device cpu|cuda] [--dtype float32|bfloat16|float16] [--attention-backend auto|flex|torch] [--prompt-len 32,128]
[--cpu-gemm onednn|torch] [--cpu-kernels compiled|torch]``. ``large`` (hidden 2048, 16 layers, ~0.9 B parameters)
is meant for a GPU.

Beside each of our figures: the fraction of the memory-bandwidth limit it reaches. A decode step of
batch ``B`` must read every weight once and the KV of every context token once; at ``--peak-gbps``
(default: the card's HBM peak where its name is known, H100 3,350 and H200 4,800 GB/s) that takes
``(weight bytes + KV bytes) / peak`` seconds, and the step took ``B / (tokens/s)``. The fraction is
the first over the second (1.0 = as fast as memory allows; the KV term uses each row's mean
context over the run).
"""

from __future__ import annotations

import argparse
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from mm_serve import LLM, SamplingParams  # noqa: E402
from mm_serve.bench.llama_checkpoints import llama_checkpoint  # noqa: E402


def _prompts(batch: int, vocab: int, seed: int, lengths: tuple[int, int] = (32, 128)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(*lengths))] for _ in range(batch)]


def _ours(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    requests = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(requests, params)
    return time.perf_counter() - start


def _hf(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> float:
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, generation_config=config).tolist()  # waits for the device
    return time.perf_counter() - start


def _decode_rate(run, batch: int, new_tokens: int, repeats: int) -> float:  # type: ignore[no-untyped-def]
    full = min(run(new_tokens) for _ in range(repeats))
    prefill = min(run(1) for _ in range(repeats))
    if full <= prefill:  # the machine's noise exceeded the decode time: no reading (printed as nan)
        return float("nan")
    return batch * (new_tokens - 1) / (full - prefill)


PEAK_GBPS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0}  # HBM peak of cards by name (vendor data sheets, SXM)


def _peak_gbps(device: str, given: float) -> float:
    """The memory bandwidth to compare against, GB/s: ``given``, else the CUDA card's by name, else 0 (unknown)."""
    if given or not device.startswith("cuda"):
        return given
    name = torch.cuda.get_device_name(torch.device(device))
    return next((peak for card, peak in PEAK_GBPS.items() if card in name), 0.0)


def _hbm_fraction(llm: LLM, prompts: list[list[int]], new_tokens: int, rate: float, peak_gbps: float) -> float:
    """Bytes a decode step must read (weights once, but of an untied embedding table only its ``batch``
    rows; each row's KV at its mean context) over the step time ``batch / rate`` seconds, as a fraction
    of ``peak_gbps``."""
    model = llm.engine.model.language_model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.embed_tokens.weight
    if all(p is not table for n, p in model.named_parameters(remove_duplicate=False) if n != "embed_tokens.weight"):
        weights -= table.numel() * table.element_size() - len(prompts) * table[0].numel() * table.element_size()
    kv = sum(len(p) + new_tokens / 2 for p in prompts) * llm.engine.kv_cache.bytes_per_token
    step_s = len(prompts) / rate
    return (weights + kv) / step_s / (peak_gbps * 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench", help="bench (8 layers, hidden 512), tiny, or a Llama checkpoint dir")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]; both runners use it")
    parser.add_argument("--enforce-eager", action="store_true", help="cuda: no CUDA graphs for our decode steps")
    parser.add_argument("--cpu-gemm", default="onednn", choices=["onednn", "torch"],
                        help="cpu: our linear layers from oneDNN-packed weights (default) or torch's F.linear (MKL)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="both runners' element type (ours: weights, KV pages; the sampler stays float32)")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "flex", "torch"])
    parser.add_argument("--prompt-len", default="32,128", help="prompt tokens drawn between these bounds (min,max)")
    parser.add_argument("--peak-gbps", type=float, default=0.0,
                        help="memory bandwidth for the fraction column, GB/s (default: the card's HBM peak by name)")
    parser.add_argument("--cpu-kernels", default="compiled", choices=["compiled", "torch"],
                        help="cpu: decode attention and RMSNorm from the compiled kernels (default) or torch ops")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import LlamaForCausalLM

    model_dir = llama_checkpoint(args.model)
    bounds = [int(x) for x in args.prompt_len.split(",")]
    low, high = bounds[0], bounds[-1]  # one number: every prompt that long
    batches = [int(b) for b in args.batches.split(",")]
    pages = max(2048, max(batches) * -(-(high + args.new_tokens) // 16) + 64)
    llm = LLM(model=model_dir, mode="colocated", num_pages=pages, max_running=max(64, *batches), device=args.device,
              enforce_eager=args.enforce_eager, cpu_gemm=args.cpu_gemm, cpu_kernels=args.cpu_kernels,
              dtype=args.dtype, attention_backend=args.attention_backend)
    reference = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, args.dtype)).eval().to(args.device)
    peak = _peak_gbps(args.device, args.peak_gbps)
    vocab = llm.engine.model_config.text.vocab_size
    graphs = "CUDA graphs" if llm.engine.runner.graphs is not None else "eager"
    backend = type(llm.engine.model.language_model.backend).__name__  # what runs, after any build fallback
    gemm = f", cpu_gemm {args.cpu_gemm}" if args.device == "cpu" else ""
    print(f"model {model_dir} | device {args.device} ({graphs}{gemm}, attention {backend}) | {args.dtype} | "
          f"threads {args.threads} | prompts {low}-{high} tokens | new tokens {args.new_tokens}"
          + (f" | bandwidth limit at {peak:.0f} GB/s" if peak else ""))
    print(f"KV cache: {llm.engine.kv_cache.bytes_per_token} bytes/token, "
          f"{llm.engine.kv_cache.bytes_per_page} bytes/page (page_size {llm.engine.config.page_size})")
    print(f"{'batch':>5} | {'mm-serve tok/s':>14} | {'of limit':>8} | {'transformers tok/s':>18} | ratio")
    for batch in batches:
        prompts = _prompts(batch, vocab, seed=batch, lengths=(low, high))
        _ours(llm, prompts, 2)  # warm-up
        ours = _decode_rate(lambda n, p=prompts: _ours(llm, p, n), batch, args.new_tokens, args.repeats)
        theirs = _decode_rate(lambda n, p=prompts: _hf(reference, p, n), batch, args.new_tokens, args.repeats)
        fraction = f"{_hbm_fraction(llm, prompts, args.new_tokens, ours, peak):.0%}" if peak else "-"
        print(f"{batch:>5} | {ours:>14.1f} | {fraction:>8} | {theirs:>18.1f} | {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
