#!/usr/bin/env bash
# Goodput of the default service (`mm-serve serve` with no placement keys, the SLOs and workload
# configured: the planner picks the placement for them) against our colocated mode, our 1P+1D placement (configs/default.yaml) and vLLM at its
# best (benchmarks/peers/serve_vllm.sh, after `make peer-vllm`): same client, workload, SLOs, probes and
# seeds. The systems alternate, ROUNDS rounds, each on a fresh server (vLLM warmed up with 30 s of load first, as benchmarks/goodput.md
# does). A round whose bench.json is already in OUT is kept (an interrupted run resumes). Prints every
# round's goodput, the medians and the ratios. Run nothing else on the machine meanwhile.
#
#   benchmarks/default_vs_peers.sh OUT WORKLOAD SLO_TTFT SLO_TPOT NUM_REQUESTS [ROUNDS] [MODEL] [SYSTEMS]
#   e.g. benchmarks/default_vs_peers.sh bench_out/peers-chatbot chatbot 1 0.05 100 3 out/bench-llama
#   SYSTEMS: a comma list of default, default_always (the default service with scheduler.decode_pacing_always),
#   colocated, disaggregated, vllm (default: default,colocated,vllm)
set -euo pipefail
out=$1 workload=$2 ttft=$3 tpot=$4 requests=$5 rounds=${6:-3} model=${7:-out/bench-llama} systems=${8:-default,colocated,vllm}
mm_serve=${MM_SERVE:-.venv/bin/mm-serve}
port=${PEER_PORT:-8001}
mkdir -p "$out"
printf 'mode: colocated\n' > "$out/colocated.yaml"
# the default service as a user with these SLOs and this traffic configures it: no placement key, the
# default tier's SLOs and placement.workload set (the planner plans for them; interactive stays tighter)
awk -v w="$workload" -v t="$ttft" -v p="$tpot" 'BEGIN {
  it = t * 1000 < 1000 ? t * 1000 : 1000; ip = p * 1000 < 100 ? p * 1000 : 100
  printf "placement:\n  workload: %s\nslo:\n  tiers:\n", w
  printf "    interactive: {ttft_ms: %g, tpot_ms: %g}\n    standard: {ttft_ms: %g, tpot_ms: %g}\n", it, ip, t * 1000, p * 1000
}' > "$out/default.yaml"
# the same, pacing every step even while the decode worker's core is otherwise idle (before 2026-12-06)
{ cat "$out/default.yaml"; printf 'scheduler:\n  decode_pacing_always: true\n'; } > "$out/default_always.yaml"
common=(--model "$model" --workload "$workload" --sweep --num-requests "$requests" --slo-ttft "$ttft" --slo-tpot "$tpot")

vllm_round() {  # $1: round
  touch "$out/vllm-r$1.server.log.start"
  bash benchmarks/peers/serve_vllm.sh "$model" "$port" > "$out/vllm-r$1.server.log" 2>&1 &
  local pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null && break
    kill -0 $pid 2>/dev/null || { echo "vLLM exited: see $out/vllm-r$1.server.log" >&2; exit 1; }
    sleep 1
  done
  "$mm_serve" bench --server "http://127.0.0.1:$port" --model "$model" --label vllm --workload chatbot \
    --rate 4 --num-requests 120 --slo-ttft 1 --slo-tpot 0.05 --out "$out/vllm-warm-up-r$1" > "$out/vllm-warm-up-r$1.log" 2>&1 || true
  "$mm_serve" bench --server "http://127.0.0.1:$port" --label vllm "${common[@]}" --seed "$1" \
    --out "$out/vllm-r$1" > "$out/vllm-r$1.log" 2>&1
  kill $pid; wait $pid 2>/dev/null || true
  trap - EXIT
  # vLLM's CPU server leaves its ZMQ IPC sockets (UUID names) and vllm_dist_* files in /tmp after SIGTERM
  find /tmp -maxdepth 1 -newer "$out/vllm-r$1.server.log.start" \( -name 'vllm_dist_*' -o \( -type s \
    -regextype posix-extended -regex '/tmp/[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}' \) \) -delete 2>/dev/null || true
  rm -f "$out/vllm-r$1.server.log.start"
}

for round in $(seq 1 "$rounds"); do
  for system in ${systems//,/ }; do
    if [ ! -f "$out/$system-r$round/bench.json" ]; then
      case $system in
        default) "$mm_serve" bench --config "$out/default.yaml" "${common[@]}" --no-admission --seed "$round" --out "$out/default-r$round" \
                   > "$out/default-r$round.log" 2>&1 ;;
        default_always) "$mm_serve" bench --config "$out/default_always.yaml" "${common[@]}" --no-admission --seed "$round" \
                          --out "$out/default_always-r$round" > "$out/default_always-r$round.log" 2>&1 ;;
        colocated) "$mm_serve" bench --config "$out/colocated.yaml" "${common[@]}" --no-admission --seed "$round" \
                     --out "$out/colocated-r$round" > "$out/colocated-r$round.log" 2>&1 ;;
        disaggregated) "$mm_serve" bench --config configs/default.yaml "${common[@]}" --no-admission --seed "$round" \
                         --out "$out/disaggregated-r$round" > "$out/disaggregated-r$round.log" 2>&1 ;;
        vllm) vllm_round "$round" ;;
        *) echo "unknown system $system (default, default_always, colocated, disaggregated, vllm)" >&2; exit 2 ;;
      esac
    fi
    python3 -c "import json,sys; print(sys.argv[2], 'round', sys.argv[3], json.load(open(sys.argv[1]))['systems'][0]['goodput'], flush=True)" \
      "$out/$system-r$round/bench.json" "$system" "$round"
  done
done
python3 - "$out" "$rounds" ${systems//,/ } <<'EOF'
import json, statistics, sys
out, rounds, systems = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
goodput = {s: [json.load(open(f"{out}/{s}-r{r}/bench.json"))["systems"][0]["goodput"] or 0.0 for r in range(1, rounds + 1)]
           for s in systems}
for s, values in goodput.items():
    print(f"{s}: median {statistics.median(values):.3f} req/s [{min(values):.3f}-{max(values):.3f}] rounds "
          + ", ".join(f"{v:.3f}" for v in values))
for a, b in (("default", "colocated"), ("default", "vllm"), ("default", "default_always"), ("default_always", "vllm"), ("colocated", "vllm"), ("disaggregated", "colocated")):
    if a in goodput and b in goodput and statistics.median(goodput[b]) > 0:
        paired = ", ".join(f"{x / y:.2f}" if y else "-" for x, y in zip(goodput[a], goodput[b]))
        print(f"{a} / {b}: {statistics.median(goodput[a]) / statistics.median(goodput[b]):.2f}x by the medians; per round {paired}")
EOF
