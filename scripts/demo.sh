#!/usr/bin/env bash
# demo.sh -- the main job on a fresh machine: install what is needed, fetch
# the evaluation model and text (../shared/EVAL.md), build, then
#   1. generate with the default KVarN cache (kvarn_k4v2_g128), and
#   2. a short eval ladder: every cache format against the fp16 cache on one
#      512-token window of Jane Austen, fed in 128-token chunks.
# For the full ladder: build/kvarn eval -m MODEL -f data/austen/all.txt --kv-cache-dtype all
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --deps --model
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc 2>/dev/null || echo 2)" --target kvarn >/dev/null

MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
echo "== kvarn generate (kvarn_k4v2_g128)"
build/kvarn generate -m "$MODEL" --kv-cache-dtype kvarn_k4v2_g128 --chat \
  -p "Write two sentences about why the sky is blue." -n 64 --temp 0
echo
echo "== kvarn eval (short ladder)"
build/kvarn eval -m "$MODEL" -f data/austen/all.txt --kv-cache-dtype all \
  --ctx 512 --chunk 128 --decode-tokens 16
