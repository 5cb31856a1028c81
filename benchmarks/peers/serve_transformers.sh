#!/usr/bin/env bash
# Peer for the image workload: `transformers serve --continuous-batching` on a local llava-hf
# checkpoint, CPU, float32, offline. Usage: serve_transformers.sh [MODEL_DIR] [PORT] [THREADS]
# (THREADS defaults to every core, as our colocated mode; it sets torch's intra-op threads).
set -euo pipefail
MODEL=${1:-out/bench-llava}
PORT=${2:-8001}
THREADS=${3:-$(nproc)}
# accelerate (needed by `transformers serve`, which always passes a device_map) is installed by
# `make peer-transformers` into .peer-transformers/, so our own .venv stays as it is.
export PYTHONPATH=.peer-transformers${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=$THREADS
exec .venv/bin/transformers serve "$MODEL" --continuous-batching --device cpu --dtype float32 \
    --host 127.0.0.1 --port "$PORT" --log-level warning
