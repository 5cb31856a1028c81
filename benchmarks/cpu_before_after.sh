#!/usr/bin/env bash
# CPU seconds per delivered token by process, before (git revision REV) and after (this checkout),
# on chatbot, code, summarization, llava and long-multimodal, one after the other per workload
# (benchmarks/results/2026-12-03-cpu-before-after.md). Needs out/bench-llama and out/bench-llava (make bench-models) and a quiet
# machine. WORKLOADS="llava long-multimodal" runs only those.
# Usage: benchmarks/cpu_before_after.sh REV [OUT_DIR]    e.g. benchmarks/cpu_before_after.sh d5ddde0
set -euo pipefail
rev=${1:?usage: $0 REV [OUT_DIR]}
here=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "${2:-$here/bench_out/cpu-before-after}" && cd "${2:-$here/bench_out/cpu-before-after}" && pwd)
before=$(mktemp -d /tmp/mmserve-before.XXXXXX)
trap 'git -C "$here" worktree remove --force "$before" >/dev/null 2>&1 || rm -rf "$before"' EXIT
git -C "$here" worktree add -f "$before" "$rev" --detach >/dev/null
run() {  # dir label workload config model rate requests
  (cd "$1" && HF_HUB_OFFLINE=1 PYTHONPATH="$1" "$here/.venv/bin/python" benchmarks/cpu_profile.py --config "$4" \
     --model "$here/out/$5" --workload "$3" --rate "$6" --num-requests "$7" --out "$out/$3-$2" > "$out/$3-$2.txt" 2>&1)
  tail -n 9 "$out/$3-$2.txt"
}
wanted=" ${WORKLOADS:-chatbot code summarization llava long-multimodal} "
for spec in "chatbot configs/default.yaml bench-llama 4 200" "code configs/default.yaml bench-llama 12 200" \
            "summarization configs/image_chat.yaml bench-llama 1.0 40" "llava configs/image_chat.yaml bench-llava 6 150" \
            "long-multimodal configs/image_chat.yaml bench-llava ${LONG_MM_RATE:-0.5} 40"; do
  set -- $spec
  [[ $wanted == *" $1 "* ]] || continue
  echo "== $1 before ($rev)"; run "$before" before "$@"
  echo "== $1 after (this checkout)"; run "$here" after "$@"
done
