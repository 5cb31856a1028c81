"""The planner's goodput against the measured one, per placement, on the probes the benchmark ran.

``benchmarks/default_vs_peers.sh`` measures each placement's goodput with ``mm-serve bench --sweep``:
probes of N requests at rates it bisects. This script runs the requests the bench planned for each
of those probes (the same draws of the workload and arrival path, from the round's seed) through the
planner's simulator with a profile's fitted times, colocated (one instance of ``--cores`` devices:
the profile's points of that many threads where it has them) and 1P+1D (one thread each), scores
them against the same SLOs, and reports per round:

* measured goodput (the bench's), and the simulated goodput on the same probes: the highest probe
  rate below the lowest simulated failure (the bench's rates, so the bisection's resolution);
* the planner's own prediction (``mm-serve serve``'s: its workload drawn afresh, probes of 400
  requests or ten turnovers, the first turnover not scored: steady state);
* the 1P+1D / colocated ratio of each, the line issue #51 item 4 asks to be within 0.2.

Usage::

    python benchmarks/planner_vs_measured.py OUT WORKLOAD SLO_TTFT SLO_TPOT --profile PROFILE.json
        [--rounds 3] [--num-requests 100] [--model out/bench-llama] [--cores 2] [--latencies]

OUT holds ``colocated-r<k>/`` and ``disaggregated-r<k>/`` from default_vs_peers.sh (or, for 1P+1D, the
default service's rounds where the planner chose it). Text workloads only.

``--systems mixed64,mixed128,apart`` instead compares the colocated rounds of
``benchmarks/mixed_steps_goodput.sh`` (``mixed<N>-r<k>/``: mixed steps of N tokens; ``apart-r<k>/``: prefill
steps apart), each simulated with its own mixed-step budget, and prints measured against simulated goodput.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from planner_calibration import one_prefill_one_decode  # noqa: E402 (benchmarks/, this script's folder)

from mm_serve.config import ConfigError, config_from_dict, load_config  # noqa: E402
from mm_serve.ground.slo import SLO  # noqa: E402
from mm_serve.planner.auto_placement import choose_placement  # noqa: E402
from mm_serve.planner.colocated_instance import MixedSteps  # noqa: E402
from mm_serve.planner.fit import fit_profile_file  # noqa: E402
from mm_serve.planner.latency_model import LatencyModel, ParallelConfig  # noqa: E402
from mm_serve.planner.sim_request import SimRequest  # noqa: E402
from mm_serve.planner.simulator import (  # noqa: E402
    DecodeServer,
    build_requests,
    simulate_colocated,
    simulate_disaggregated,
)
from mm_serve.workloads import make_workload, unit_rate_arrivals  # noqa: E402

SYSTEMS = ("colocated", "disaggregated")


def probe_rates(records: Path) -> list[float]:
    """The rates (requests/s) of the probes the bench ran, from its records (the unloaded rows, rate 0,
    left out)."""
    rates = {float(json.loads(line)["rate"]) for line in records.read_text().splitlines() if line.strip()}
    return sorted(r for r in rates if r > 0)


def planned_requests(workload: str, max_context: int, seed: int, n: int, rate: float) -> list[SimRequest]:
    """The requests ``mm-serve bench --seed seed --num-requests n`` plans for a probe at ``rate``
    requests/s: the workload's first draws on its unit-rate arrival path scaled by ``1 / rate``
    (:meth:`mm_serve.bench.runner.SweepRunner.plan_at`), ``n`` of them or as many as arrive in three
    minutes (the bench's cap at its default 60 s duration), all of them, sent or not (a probe the bench
    stopped early never sent its last ones)."""
    n = min(n, max(1, math.ceil(rate * 3 * 60.0)))
    specs = make_workload(workload, 0, max_context).sample(n, seed)
    return build_requests(specs, [t / rate for t in unit_rate_arrivals(n, seed, 1.0)])


def mixed_budget(system: str) -> int | None:
    """The mixed-step budget a colocated system runs with (tokens): the default config's for ``colocated``, N for
    ``mixed<N>``, 0 for ``apart``; None for 1P+1D (``disaggregated``).

    Raises:
        SystemExit: a name that is none of these.
    """
    if system == "disaggregated":
        return None
    if system == "colocated":
        return load_config(None).scheduler.mixed_step_tokens
    if system == "apart":
        return 0
    if system.startswith("mixed") and system[5:].isdecimal() and system[5:].isascii() and int(system[5:]) > 0:
        return int(system[5:])
    sys.exit(f"error: unknown system {system!r} (colocated, disaggregated, apart or mixed<N>, N >= 1)")


def simulated_attainment(requests: list[SimRequest], system: str, model: LatencyModel, cores: int,
                         slo: SLO, front_end_s: float) -> float:
    """Share of ``requests`` whose run in the simulator meets both SLOs: colocated (one instance of
    ``cores`` devices, with the system's mixed-step budget: :func:`mixed_budget`, its steps stalled
    ``front_end_s`` seconds per sequence on more than one core, as the planner prices it) or 1P+1D (one
    device each), the default config's batch limits and KV capacity."""
    cfg = load_config(None)
    capacity = cfg.kv_cache.max_pages_per_gpu * cfg.kv_cache.page_size
    budget = mixed_budget(system)
    if budget is not None:
        par = ParallelConfig(cores, 1)
        server = DecodeServer(model.decode_timing(par, front_end_s_per_token=front_end_s), capacity,
                              cfg.scheduler.decode_max_concurrent)
        mixed = MixedSteps(budget, cfg.scheduler.prefill_batch_size, cfg.kv_cache.page_size) if budget else None
        simulate_colocated(model.prefill_timing(par), server, cfg.scheduler.prefill_token_budget, requests, mixed=mixed)
    else:
        prefill, decode, handoff = one_prefill_one_decode(model, cfg)
        simulate_disaggregated([prefill], [decode], [[handoff]], requests)
    ok = sum(1 for r in requests if r.ttft <= slo.ttft_s and r.tpot <= slo.tpot_s)
    return ok / max(1, len(requests))


def replayed_latencies(records: list[dict[str, Any]], rate: float, system: str, model: LatencyModel, cores: int,
                       slo: SLO, front_end_s: float) -> str:
    """Mean TTFT and TPOT of a probe's answered requests, measured and simulated: the probe's own rows of
    the bench's ``records`` (send times, prompt and output lengths) replayed through the simulator as ``system``. Where the
    simulated TPOT is far below the measured one at a low rate, the profile's step times are not what
    the service ran at (the machine's speed changed, or the service spends time the profile does not)."""
    rows = [r for r in records if float(r["rate"]) == rate and r["error"] is None and r["tpot_s"] is not None]
    if not rows:
        return "no answered request"
    start = min(float(r["sent_s"]) for r in rows)
    replayed = [SimRequest(i, float(r["sent_s"]) - start, int(r["prompt_tokens"] or 1),
                           max(1, int(r["output_tokens"] or 1))) for i, r in enumerate(rows)]
    simulated_attainment(replayed, system, model, cores, slo, front_end_s)

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    return (f"TTFT mean {mean([float(r['ttft_s']) for r in rows]):.3f} / {mean([q.ttft for q in replayed]):.3f} s, "
            f"TPOT mean {1e3 * mean([float(r['tpot_s']) for r in rows]):.1f} / "
            f"{1e3 * mean([q.tpot for q in replayed]):.1f} ms (measured / replayed, {len(rows)} requests)")


def probe_goodput(passed: dict[float, bool]) -> float:
    """The highest probe rate below the lowest failing one (0.0 when the lowest fails)."""
    best = 0.0
    for rate, ok in sorted(passed.items()):
        if not ok:
            break
        best = rate
    return best


def measured_run(out: Path, system: str, k: int) -> tuple[Path, Path]:
    """The folder and records file of round ``k`` of ``system`` in ``out``: ``<system>-r<k>/``, or for 1P+1D
    the default service's round where the planner chose it (``default-r<k>/records-auto-1P+1D.jsonl``); a
    ``mixed<N>`` or ``apart`` round's records are its colocated server's."""
    records = "colocated" if system == "apart" or system.startswith("mixed") else system
    options = [(out / f"{system}-r{k}", f"records-{records}.jsonl")]
    if system == "disaggregated":
        options.append((out / f"default-r{k}", "records-auto-1P+1D.jsonl"))
    for folder, name in options:
        if (folder / "bench.json").is_file() and (folder / name).is_file():
            return folder, folder / name
    script = "default_vs_peers.sh" if records == system else "mixed_steps_goodput.sh"
    sys.exit(f"error: no round {k} of {system} in {out} (run benchmarks/{script} first)")


def planner_prediction(model_dir: Path, profile: Path, workload: str, slo: SLO, cores: int,
                       front_end_s: float) -> dict[str, float]:
    """``mm-serve serve``'s predicted goodput of each candidate (requests/s) for these SLOs and workload."""
    tier = {"ttft_ms": slo.ttft_s * 1000, "tpot_ms": slo.tpot_s * 1000}
    placement = {"workload": workload, "front_end_ms_per_token": front_end_s * 1000}
    cfg = config_from_dict({"placement": placement, "slo": {"tiers": {
        "interactive": {"ttft_ms": min(1000.0, tier["ttft_ms"]), "tpot_ms": min(100.0, tier["tpot_ms"])},
        "standard": tier}}})
    choice = choose_placement(cfg, model_dir, profile, list(range(cores)))
    # the measured 1P+1D is configs/default.yaml's unit; the shared-core candidate is another placement
    names = {"colocated": "colocated", "1P+1D": "disaggregated"}
    return {names[name]: rate for name, rate in choice.predicted.items() if name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("workload")
    parser.add_argument("slo_ttft", type=float, help="seconds")
    parser.add_argument("slo_tpot", type=float, help="seconds")
    parser.add_argument("--profile", type=Path, required=True, help="an mm-serve profile of the model on this machine")
    parser.add_argument("--rounds", type=int, default=3, help="rounds k = 1.. (the bench's --seed k)")
    parser.add_argument("--num-requests", type=int, default=100, help="requests per probe (the bench's)")
    parser.add_argument("--model", type=Path, default=Path("out/bench-llama"))
    parser.add_argument("--cores", type=int, default=2, help="cores of the machine measured")
    parser.add_argument("--latencies", action="store_true",
                        help="also replay each probe's records and print mean TTFT and TPOT, measured / simulated")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help="the rounds' systems: colocated,disaggregated (default), or mixed<N>/apart rounds")
    parser.add_argument("--front-end-ms-per-token", type=float, default=None,
                        help="the front end's CPU per streamed token that stalls a colocated worker (default: "
                             "the config's placement.front_end_ms_per_token; 0: not priced)")
    args = parser.parse_args()
    systems = tuple(args.systems.split(","))
    for system in systems:
        mixed_budget(system)  # an unknown name stops here, before any round is read
    if not args.profile.is_file():
        sys.exit(f"error: no profile at {args.profile} (mm-serve profile writes one)")
    slo = SLO(args.slo_ttft, args.slo_tpot)
    given = {} if args.front_end_ms_per_token is None else {"placement.front_end_ms_per_token": args.front_end_ms_per_token}
    try:  # the config's default and bounds
        front_end_ms = load_config(None, given).placement.front_end_ms_per_token
    except ConfigError as exc:
        sys.exit(f"error: --front-end-ms-per-token: {exc}")
    front_end_s = front_end_ms / 1000
    fit = fit_profile_file(args.profile)
    model = LatencyModel(fit.shape, fit.hardware)
    measured: dict[str, list[float]] = {s: [] for s in systems}
    simulated: dict[str, list[float]] = {s: [] for s in systems}
    for system in systems:
        for k in range(1, args.rounds + 1):
            folder, found = measured_run(args.out, system, k)
            result = json.loads((folder / "bench.json").read_text())["systems"][0]
            measured[system].append(float(result["goodput"] or 0.0))
            runs = {float(run["rate"]): run for run in result["sweep"]["runs"]}
            passed = {}
            rows = [json.loads(line) for line in found.read_text().splitlines() if line.strip()] if args.latencies else []
            for rate in probe_rates(found):
                requests = planned_requests(args.workload, fit.shape.max_context, k, args.num_requests, rate)
                attained = simulated_attainment(requests, system, model, args.cores, slo, front_end_s)
                passed[rate] = attained >= 0.9
                run = runs.get(rate, {})
                stopped = " (stopped early)" if run.get("stopped_early") else ""
                print(f"  {folder.name} at {rate:7.3f} req/s: measured {100 * float(run.get('attainment', 0)):5.1f} %"
                      f"{stopped}, simulated {100 * attained:5.1f} %")
                if args.latencies:
                    print(f"    {replayed_latencies(rows, rate, system, model, args.cores, slo, front_end_s)}")
            simulated[system].append(probe_goodput(passed))
    if systems != SYSTEMS:
        print(f"{args.workload}, SLO TTFT {slo.ttft_s:g} s / TPOT {slo.tpot_s * 1e3:g} ms at 90 %; profile {args.profile}")
        for system in systems:
            pairs = ", ".join(f"{m:.3f} / {s:.3f}" for m, s in zip(measured[system], simulated[system], strict=True))
            print(f"{system}: measured / simulated goodput per round {pairs}")
        return
    steady = planner_prediction(args.model, args.profile, args.workload, slo, args.cores, front_end_s)
    if set(steady) != set(SYSTEMS):
        sys.exit("error: the planner's candidates hold no colocated or no 1P+1D placement")
    print(f"{args.workload}, SLO TTFT {slo.ttft_s:g} s / TPOT {slo.tpot_s * 1e3:g} ms at 90 %; profile {args.profile}; "
          f"front end {front_end_ms:g} ms per token")
    print(f"{'round':>5} | {'colocated meas / sim':>21} | {'1P+1D meas / sim':>17} | ratio 1P+1D/colocated meas / sim")
    for k in range(args.rounds):
        mc, sc = measured["colocated"][k], simulated["colocated"][k]
        md, sd = measured["disaggregated"][k], simulated["disaggregated"][k]
        print(f"{k + 1:>5} | {mc:>9.3f} / {sc:<9.3f} | {md:>7.3f} / {sd:<7.3f} | "
              f"{md / mc if mc else float('nan'):.2f} / {sd / sc if sc else float('nan'):.2f}")
    ratio = steady["disaggregated"] / steady["colocated"] if steady["colocated"] else float("nan")
    print(f"planner at start (steady state): colocated {steady['colocated']:.3f}, 1P+1D {steady['disaggregated']:.3f} "
          f"req/s, ratio {ratio:.2f}")


if __name__ == "__main__":
    main()
