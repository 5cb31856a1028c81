#!/usr/bin/env bash
# Goodput of colocated mode with mixed steps against colocated mode with prefill and decode steps
# apart: same client, workload, SLOs, probes and seeds; the two alternate, ROUNDS rounds, each on a
# fresh server. Prints every round's goodput and the medians.
#
#   benchmarks/mixed_steps_goodput.sh OUT WORKLOAD SLO_TTFT SLO_TPOT NUM_REQUESTS [BUDGET] [ROUNDS] [MODEL]
#   e.g. benchmarks/mixed_steps_goodput.sh bench_out/mixed-sum summarization 7 0.07 40 256 3 out/bench-llama
set -euo pipefail
out=$1 workload=$2 ttft=$3 tpot=$4 requests=$5 budget=${6:-512} rounds=${7:-3} model=${8:-out/bench-llama}
mm_serve=${MM_SERVE:-.venv/bin/mm-serve}
mkdir -p "$out"
printf 'model: embedded\nmode: colocated\nscheduler:\n  mixed_step_tokens: %s\n' "$budget" > "$out/mixed.yaml"
printf 'model: embedded\nmode: colocated\nscheduler:\n  mixed_step_tokens: 0\n' > "$out/apart.yaml"
for round in $(seq 1 "$rounds"); do
  for system in mixed apart; do
    "$mm_serve" bench --config "$out/$system.yaml" --model "$model" --workload "$workload" \
      --sweep --no-admission --num-requests "$requests" --slo-ttft "$ttft" --slo-tpot "$tpot" \
      --seed "$round" --out "$out/$system-r$round" > "$out/$system-r$round.log" 2>&1
    python3 -c "import json,sys; print(sys.argv[2], 'round', sys.argv[3], json.load(open(sys.argv[1]))['systems'][0]['goodput'])" \
      "$out/$system-r$round/bench.json" "$system" "$round"
  done
done
python3 - "$out" "$rounds" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
medians = {}
for system in ("mixed", "apart"):
    values = [json.load(open(f"{out}/{system}-r{r}/bench.json"))["systems"][0]["goodput"] for r in range(1, rounds + 1)]
    medians[system] = statistics.median(values)
    print(f"{system}: median {medians[system]:.3f} req/s [{min(values):.3f}-{max(values):.3f}] rounds {values}")
print(f"mixed / apart: {medians['mixed'] / medians['apart']:.2f}x")
EOF
