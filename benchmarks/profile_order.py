"""How the order of a profile's points moves the planner's choice: profiles taken in pairs, one timing
every size on one thread and then every size on two (the order before 2026-12-08), the other timing each
size on both counts before the next (``mm_serve.planner.profiler``'s order since), alternating which goes
first; for each, the planner's predicted 1P+1D / colocated goodput ratio on code (SLO 0.797 s / 32.4 ms)
and chatbot (1 s / 50 ms) on 2 cores, front end 0.35 ms per token. Prints every profile's ratios and
each order's median, range and standard deviation. The profiles (``mm-serve serve``'s sizes, 2 passes a
point, as its profile took them until 2026-12-08; 3 since) are kept in OUT. Run nothing else meanwhile; about a minute per profile. Usage::

    python benchmarks/profile_order.py OUT PAIRS [BASE_PROFILE]

BASE_PROFILE: a profile of this model on this machine whose other fields (memory, model, dtype) the
new ones copy (default: benchmarks/results/2026-12-08-profile-bench-llama-xeon-2core-before.json).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from planner_vs_measured import planner_prediction  # noqa: E402 (benchmarks/, this script's folder)

from mm_serve.ground.slo import SLO  # noqa: E402
from mm_serve.planner.auto_placement import PROFILE_SIZES  # noqa: E402
from mm_serve.planner.profiler import measure_points, sized_profiler  # noqa: E402

MODEL = Path("out/bench-llama")
WORKLOADS = (("code", SLO(0.797, 0.0324)), ("chatbot", SLO(1.0, 0.05)))
FRONT_END_S_PER_TOKEN = 0.35e-3


def main() -> None:
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    out, pairs = Path(sys.argv[1]), int(sys.argv[2])
    base_path = sys.argv[3] if len(sys.argv) == 4 else "benchmarks/results/2026-12-08-profile-bench-llama-xeon-2core-before.json"
    base = json.loads(Path(base_path).read_text())
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    batches = PROFILE_SIZES["decode_batches"]
    prof, tokens, contexts = sized_profiler(MODEL, 2, PROFILE_SIZES["prefill_tokens"], batches,
                                            PROFILE_SIZES["decode_contexts"], "float32")

    def rows(counts: list[int]) -> list[dict[str, list[dict[str, float]]]]:
        return measure_points(prof, counts, tokens, batches, contexts, lambda line: None)

    ratios: dict[str, dict[str, list[float]]] = {"sequential": {}, "interleaved": {}}
    for k in range(pairs):
        for order in ("sequential", "interleaved") if k % 2 == 0 else ("interleaved", "sequential"):
            start = time.perf_counter()
            one, two = rows([1]) + rows([2]) if order == "sequential" else rows([1, 2])
            path = out / f"{order}-{k}.json"
            path.write_text(json.dumps({**base, **one, "tensor_parallel": [{"degree": 2, **two}]}))
            line = [f"{order:11s} {k}: profiled in {time.perf_counter() - start:4.1f} s"]
            for workload, slo in WORKLOADS:
                rate = planner_prediction(MODEL, path, workload, slo, 2, FRONT_END_S_PER_TOKEN)
                ratio = rate["disaggregated"] / rate["colocated"]
                ratios[order].setdefault(workload, []).append(ratio)
                line.append(f"{workload} {ratio:.3f} (colocated {rate['colocated']:.3f}, 1P+1D {rate['disaggregated']:.3f})")
            print(", ".join(line), flush=True)
    for order, by_workload in ratios.items():
        for workload, values in by_workload.items():
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            print(f"{order} {workload}: median {statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}], "
                  f"stdev {spread:.3f}")


if __name__ == "__main__":
    main()
