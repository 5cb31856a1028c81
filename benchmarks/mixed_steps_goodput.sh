#!/usr/bin/env bash
# Goodput of colocated mode with mixed steps (one system per budget) against colocated mode with
# prefill and decode steps apart: same client, workload, SLOs, probes and seeds; the systems
# alternate, ROUNDS rounds, each on a fresh server. A round whose bench.json is already in OUT is
# kept (an interrupted run resumes). Prints every round's goodput and the medians.
#
#   benchmarks/mixed_steps_goodput.sh OUT WORKLOAD SLO_TTFT SLO_TPOT NUM_REQUESTS [BUDGETS] [ROUNDS] [MODEL]
#   e.g. benchmarks/mixed_steps_goodput.sh bench_out/mixed-sum summarization 7 0.07 40 256,2048 3 out/bench-llama
set -euo pipefail
out=$1 workload=$2 ttft=$3 tpot=$4 requests=$5 budgets=${6:-256} rounds=${7:-3} model=${8:-out/bench-llama}
mm_serve=${MM_SERVE:-.venv/bin/mm-serve}
mkdir -p "$out"
systems=()
for budget in ${budgets//,/ }; do
  printf 'model: embedded\nmode: colocated\nscheduler:\n  mixed_step_tokens: %s\n' "$budget" > "$out/mixed$budget.yaml"
  systems+=("mixed$budget")
done
printf 'model: embedded\nmode: colocated\nscheduler:\n  mixed_step_tokens: 0\n' > "$out/apart.yaml"
systems+=(apart)
for round in $(seq 1 "$rounds"); do
  for system in "${systems[@]}"; do
    if [ ! -f "$out/$system-r$round/bench.json" ]; then
      "$mm_serve" bench --config "$out/$system.yaml" --model "$model" --workload "$workload" \
        --sweep --no-admission --num-requests "$requests" --slo-ttft "$ttft" --slo-tpot "$tpot" \
        --seed "$round" --out "$out/$system-r$round" > "$out/$system-r$round.log" 2>&1
    fi
    python3 -c "import json,sys; print(sys.argv[2], 'round', sys.argv[3], json.load(open(sys.argv[1]))['systems'][0]['goodput'])" \
      "$out/$system-r$round/bench.json" "$system" "$round"
  done
done
python3 - "$out" "$rounds" "${systems[@]}" <<'EOF'
import json, statistics, sys
out, rounds, systems = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
medians = {}
for system in systems:
    values = [json.load(open(f"{out}/{system}-r{r}/bench.json"))["systems"][0]["goodput"] for r in range(1, rounds + 1)]
    medians[system] = statistics.median(values)
    print(f"{system}: median {medians[system]:.3f} req/s [{min(values):.3f}-{max(values):.3f}] rounds "
          + ", ".join(f"{v:.3f}" for v in values))
for system in systems[:-1]:
    print(f"{system} / apart: {medians[system] / medians['apart']:.2f}x")
EOF
