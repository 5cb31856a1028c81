#!/usr/bin/env bash
# GPU checks in one run, for a machine with CUDA (the CPU CI never runs this):
#   1. tests/test_cuda.py: our runner on the GPU == transformers on the GPU (greedy ids, first-step
#      logits) in float32, bfloat16 and float16, a batch of mixed cases, FlexAttention compiled inside
#      CUDA graphs, and the disaggregated service with GPU KV caches and a host ring;
#   2. decode throughput of the ~0.9 B model (`large`) with ~1,000-token contexts at batch 1 and 64, ours vs
#      transformers' generate, with the fraction of the HBM bandwidth limit beside each figure: float32,
#      bfloat16, and bfloat16 on FlexAttention;
#   3. the whole test suite with CUDA present (everything must still pass where CUDA is visible).
# Usage: OUT=DIR PYTHON=python3 benchmarks/gpu_check.sh   (torch with CUDA and the project's deps installed,
# dev extra included: pytest-xdist and pytest-timeout too). Results of a run: benchmarks/results/.
# Each step has its own time limit so that one slow step cannot eat the others' time (all within 10
# minutes); FULL_SUITE_S=0 skips 3.
set -u
OUT=${OUT:-/tmp/mm_serve_gpu_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s) ==="
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.txt"
    echo "=== $name: exit $rc in $((SECONDS - start)) s ==="
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PY" -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"

step cuda_tests 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py -rs
LARGE=(benchmarks/decode_throughput.py --model large --device cuda --threads 8 --batches 1,64 --prompt-len 900,1100
       --new-tokens 64)
step decode_large_fp32 130 "$PY" "${LARGE[@]}" --dtype float32
step decode_large_bf16 80 "$PY" "${LARGE[@]}" --dtype bfloat16
step decode_large_bf16_flex 110 "$PY" "${LARGE[@]}" --dtype bfloat16 --attention-backend flex
if [ "${FULL_SUITE_S:-160}" -gt 0 ]; then  # the suite takes ~18 min on 2 cores: this is a sample of it
    OMP_NUM_THREADS=2 step full_suite "${FULL_SUITE_S:-160}" "$PY" -m pytest -q -p no:cacheprovider -n 4 --timeout 60 tests
fi
