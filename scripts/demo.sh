#!/usr/bin/env bash
# demo.sh -- the main job on a fresh machine: install what is needed, fetch
# the evaluation model and text (docs/model-setup.md), build, then
#   1. generate with the default KVarN cache (kvarn_k4v2_g128), continuing
#      the opening of Pride and Prejudice (~500 tokens, so that tiles past the
#      staged sink tile are committed to 4/2-bit records), and
#   2. a short eval ladder: every cache format against the fp16 cache on one
#      1024-token window of Jane Austen, fed in 128-token chunks.
# For the full ladder: build/kvarn eval -m MODEL -f data/austen/all.txt --kv-cache-dtype all
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --deps --model
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc 2>/dev/null || echo 2)" --target kvarn >/dev/null

MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
PROMPT=$(head -c 2200 data/austen/prideprejudice.txt)
echo "== kvarn generate (kvarn_k4v2_g128): the model continues the first 2200 characters of"
echo "   Pride and Prejudice, which end with: ...${PROMPT: -160}"
echo "   (64 tokens, greedy; stdout is the continuation only, stderr the cache's size and speed)"
build/kvarn generate -m "$MODEL" --kv-cache-dtype kvarn_k4v2_g128 -p "$PROMPT" -n 64 --temp 0
echo
echo "== kvarn eval (short ladder: one 1024-token window, 16 tokens decoded, so 15 decode"
echo "   positions: a small, noisy sample; the README's table is the 2048-token run)"
build/kvarn eval -m "$MODEL" -f data/austen/all.txt --kv-cache-dtype all \
  --ctx 1024 --chunk 128 --decode-tokens 16
