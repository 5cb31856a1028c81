"""``mm-serve plan``: size a disaggregated cluster for a model, workload and SLOs.

Example::

    mm-serve plan --model path/to/opt-13b --workload chatbot \\
        --slo-ttft 0.25 --slo-tpot 0.1 --hardware a100-80gb --nodes 4 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``plan`` sub-command to the ``mm-serve`` parser."""
    p = subparsers.add_parser(
        "plan",
        help="search the prefill/decode placement with the best per-GPU goodput",
        description="Simulate prefill and decode parallel configs (DistServe Algorithms 1 "
        "and 2) and print the placement with the best per-GPU goodput, next to the best "
        "colocated configuration.",
    )
    p.add_argument("--model", required=True, help="model directory or a bare config.json "
                   "(OPT, Llama-family, LLaVA / llava-hf)")
    p.add_argument("--workload", default="chatbot",
                   help="chatbot, code, summarization, llava, long-multimodal, caption, or a JSONL "
                   "workload file (default: chatbot)")
    p.add_argument("--slo-ttft", type=float, required=True, help="TTFT SLO, seconds")
    p.add_argument("--slo-tpot", type=float, required=True, help="TPOT SLO, seconds")
    p.add_argument("--attainment", type=float, default=0.9,
                   help="fraction of requests that must meet both SLOs (default 0.9)")
    p.add_argument("--hardware", default="a100-80gb",
                   help="a100-80gb, h100-80gb, h200-141gb, or a measured profile JSON file")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                   help="devices per node: GPUs, or with --device cpu one-thread CPU worker slots (cores) "
                   "(default 8; with --device cpu, this machine's usable cores, at most 64)")
    p.add_argument("--nodes", type=int, default=1, help="nodes of the cluster (default 1)")
    p.add_argument("--affinity", choices=("high", "low"), default="high",
                   help="high: KV may cross nodes; low: each prefill stage's decode partner "
                   "stays on its node (default high)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--write-config", metavar="PATH",
                   help="write the placement as an mm-serve config YAML (with --nodes > 1: for "
                   "cluster.backend ray, each instance on its node)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="what the written config runs the workers on: cuda (the planned GPU ids) or "
                   "cpu (the planned devices are CPU worker slots, e.g. with a CPU profile as "
                   "--hardware; default cuda)")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    p.add_argument("--num-requests", type=int, default=400,
                   help="minimum simulated requests per probe (default 400)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="CV of inter-arrival gaps; 1 = Poisson (default 1)")
    p.add_argument("--prefill-token-budget", type=int, default=2048,
                   help="prompt tokens per prefill batch (default 2048)")
    p.add_argument("--decode-max-batch", type=int, default=256,
                   help="running requests per decode instance (default 256)")
    p.add_argument("--front-end-ms-per-token", type=float, default=None, metavar="MS",
                   help="CPU milliseconds the front end spends per streamed token, which stall an instance "
                   "of several CPU threads (default: with --device cpu, placement.front_end_ms_per_token's "
                   "default, as mm-serve serve plans; else 0)")
    p.set_defaults(func=run)


def _model_dir(model: str) -> str:
    path = Path(model)
    return str(path.parent if path.is_file() else path)


MAX_SLO_S = 3600.0  # an SLO of over an hour per token is a typo, not a target
LOOSE_TTFT_S, LOOSE_TPOT_S = 10.0, 1.0  # beyond these the finite probes cannot reveal overload


def _check_writable(path: str) -> None:
    """Fail before a long search if ``--write-config`` cannot be written."""
    from mm_serve.cli.main import CLIError

    if not path.strip():
        raise CLIError("--write-config needs a file path")
    target = Path(path)
    parent = target.parent  # "." for a bare file name
    if target.is_dir() or path.endswith(("/", os.sep)):
        raise CLIError(f"--write-config {path}: is a directory (give a file path)")
    if target.exists() and not target.is_file():
        raise CLIError(f"--write-config {path}: not a regular file")
    if parent.exists() and not parent.is_dir():
        raise CLIError(f"--write-config {path}: {parent} is not a directory")
    if not parent.is_dir():
        raise CLIError(f"--write-config {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise CLIError(f"--write-config {path}: not writable")


def run(args: argparse.Namespace) -> int:
    """Run the search and print the result; user errors raise ``CLIError``."""
    from mm_serve.cli.main import CLIError
    from mm_serve.config import PlacementConfig
    from mm_serve.ground.slo import SLO
    from mm_serve.planner.errors import PlannerError
    from mm_serve.planner.fit import resolve_hardware
    from mm_serve.planner.model_shape import load_model_shape
    from mm_serve.planner.plan_spec import PlanSpec
    from mm_serve.planner.report import plan_dict, plan_text
    from mm_serve.planner.search import plan
    from mm_serve.workloads import WorkloadError, make_workload

    if not (0 < args.slo_ttft <= MAX_SLO_S and 0 < args.slo_tpot <= MAX_SLO_S):
        raise CLIError(f"SLOs must be > 0 and at most {MAX_SLO_S:g} seconds, got --slo-ttft "
                       f"{args.slo_ttft} --slo-tpot {args.slo_tpot}")
    front_end_ms = args.front_end_ms_per_token
    if front_end_ms is None:
        front_end_ms = PlacementConfig().front_end_ms_per_token if args.device == "cpu" else 0.0
    if not 0 <= front_end_ms <= 100:
        raise CLIError(f"--front-end-ms-per-token must be in 0..100 milliseconds, got {front_end_ms}")
    if args.write_config is not None:
        _check_writable(args.write_config)
    gpus_per_node = args.gpus_per_node
    if gpus_per_node is None:
        from mm_serve.planner.auto_placement import usable_cores
        from mm_serve.planner.plan_spec import MAX_GPUS_PER_NODE

        gpus_per_node = min(len(usable_cores()), MAX_GPUS_PER_NODE) if args.device == "cpu" else 8
    try:
        from mm_serve.models.named_models import NAMED_MODELS

        shape = load_model_shape(NAMED_MODELS.get(args.model, args.model))  # registered names too (embedded)
        hardware, profile = resolve_hardware(args.hardware)
        if profile is not None and profile.measured_under_load is not None:
            print(f"mm-serve: warning: {args.hardware} was measured while other processes kept "
                  f"{profile.measured_under_load:.0%} of its cores busy: its times are slower than this machine's "
                  "(measure again with `mm-serve profile` when it is idle)", file=sys.stderr)
        workload = make_workload(args.workload, shape.image_tokens, shape.max_context)
        spec = PlanSpec(
            shape=shape, hardware=hardware, workload=workload,
            slo=SLO(args.slo_ttft, args.slo_tpot), attainment=args.attainment,
            nodes=args.nodes, gpus_per_node=gpus_per_node, affinity=args.affinity,
            num_requests=args.num_requests, seed=args.seed, burstiness=args.burstiness,
            prefill_token_budget=args.prefill_token_budget, decode_max_batch=args.decode_max_batch,
            front_end_s_per_token=front_end_ms / 1000,
        )
        result = plan(spec)
        if args.slo_ttft >= LOOSE_TTFT_S or args.slo_tpot >= LOOSE_TPOT_S:
            print(f"mm-serve: warning: SLOs this loose (TTFT >= {LOOSE_TTFT_S:g} s or TPOT >= "
                  f"{LOOSE_TPOT_S:g} s) can hide overload in a finite simulation: a goodput may be "
                  "its candidate's capacity, the most its profiled steps allow, rather than a rate its "
                  "SLOs hold at (docs/planner.md section 7)", file=sys.stderr)
        written = None
        if args.write_config is not None:
            from mm_serve.planner.plan_config import write_placement_config

            write_placement_config(result, _model_dir(args.model), args.write_config, args.device)
            written = args.write_config
    except (PlannerError, WorkloadError) as exc:
        raise CLIError(str(exc)) from None
    if args.json:
        out = plan_dict(result)
        out["config_written"] = written
        print(json.dumps(out, indent=2))
    else:
        print(plan_text(result, "core" if args.device == "cpu" else "GPU"))
        if written:
            print(f"Config written to {written}" + (" (the disaggregated placement; colocated was predicted higher)"
                                                   if result.ratio < 1 else ""))
    return 0

