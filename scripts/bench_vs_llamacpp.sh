#!/usr/bin/env bash
# bench_vs_llamacpp.sh -- kvarn's decode speed side by side with llama.cpp's
# on the same GGUF. Builds nothing from elsewhere: kvarn's side is
# build/bench_decode (cmake --build build --target bench_decode); llama.cpp's
# side runs only when a llama-bench binary is given (-l PATH, or the
# LLAMA_BENCH variable, or `llama-bench` on PATH), else only kvarn's side is
# printed, and the script says so.
#
#   scripts/bench_vs_llamacpp.sh [-l LLAMA_BENCH] [-m MODEL] [-t THREADS]
#                                [-r ROUNDS] [-d 0,2048,8000] [-n DECODE]
#                                [-w WEIGHTS[,WEIGHTS]]
#
# Getting a llama-bench (CPU only; outside this repository, nothing of it
# is committed here): a llama.cpp source tree (its repository, or the copy
# the llama-cpp-python source package carries under vendor/llama.cpp), then
#   cmake -S SRC -B SRC/build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
#   cmake --build SRC/build -j2 --target llama-bench
# and pass -l SRC/build/bin/llama-bench.
#
# Per round, the engines take turns (kvarn, then llama.cpp with each cache
# type), so that load from other users of the machine falls on all alike;
# each figure is the median over the rounds, and the spread (min-max over
# the rounds) is printed under the table. kvarn: decode tokens/s of
# single-token forward calls starting at each depth (DECODE x 3 tokens, the
# median third), caches fp16, int8, kvarn_k4v2_g128, weights as the library
# chooses, or once per precision listed by -w (fp32, bf16, int8, gguf:
# kvarn's rows are then named kvarn/PRECISION). llama.cpp: llama-bench -p 0
# -n DECODE*3 -d DEPTH with K and V caches f16, q8_0, q4_0 (flash attention
# on, which quantized V needs). Both use THREADS threads (kvarn: weights and
# attention). On a loaded machine llama.cpp's spinning threads suffer more
# than kvarn's when THREADS is the core count: compare at -t 1 too.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
THREADS=2
ROUNDS=3
DEPTHS=0,2048,8000
DECODE=16
WEIGHTS=
LLAMA_BENCH=${LLAMA_BENCH:-$(command -v llama-bench || true)}
while getopts "l:m:t:r:d:n:w:h" o; do
  case "$o" in
    l) LLAMA_BENCH=$OPTARG ;;
    m) MODEL=$OPTARG ;;
    t) THREADS=$OPTARG ;;
    r) ROUNDS=$OPTARG ;;
    d) DEPTHS=$OPTARG ;;
    n) DECODE=$OPTARG ;;
    w) WEIGHTS=$OPTARG ;;
    h) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit 2 ;;
  esac
done
BENCH=${KVARN_BUILD_DIR:-build}/bench_decode
[ -x "$BENCH" ] || { echo "no $BENCH: cmake --build build --target bench_decode" >&2; exit 2; }
[ -f "$MODEL" ] || { echo "no $MODEL: bash scripts/setup.sh --model" >&2; exit 2; }
if [ -n "$LLAMA_BENCH" ] && [ ! -x "$LLAMA_BENCH" ]; then
  echo "llama-bench: $LLAMA_BENCH is not an executable" >&2; exit 2
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# kvarn decodes DECODE x 3 tokens ending at depth + DECODE x 3, which must
# fit the model's context (bench_decode prints n/a past it; SmolLM2: 8192).
KV_CTX=$(echo "$DEPTHS" | tr ',' '\n' | awk -v n=$((DECODE * 3)) '{printf "%s%d", s, $1 + n; s=","}')
NGEN=$((DECODE * 3))
for r in $(seq 1 "$ROUNDS"); do
  for w in $(echo "${WEIGHTS:-default}" | tr , " "); do
    eng=kvarn
    [ "$w" = default ] || eng=kvarn/$w
    echo "round $r/$ROUNDS: $eng" >&2
    # shellcheck disable=SC2046
    env $([ "$w" = default ] || echo "KVARN_WEIGHTS=$w") \
      OPENBLAS_NUM_THREADS="$THREADS" OMP_NUM_THREADS="$THREADS" "$BENCH" -m "$MODEL" \
      --ctx "$KV_CTX" --kv-cache-dtype int8,kvarn_k4v2_g128 --decode "$DECODE" --repeat 3 \
      --threads "$THREADS" 2>/dev/null > "$TMP/kvarn.$r.$w"
    # rows: "<format> <tok/s> <ratio>x ..." after the header line
    awk -v e="$eng" 'f && NF { for (i = 2; i <= NF; i += 2) print e, $1, (i / 2), $i }
                     /^format/ { f = 1 }' "$TMP/kvarn.$r.$w" >> "$TMP/rows"
    grep '^weights:' "$TMP/kvarn.$r.$w" >> "$TMP/weights" || true
  done
  if [ -n "$LLAMA_BENCH" ]; then
    for ct in f16 q8_0 q4_0; do
      echo "round $r/$ROUNDS: llama.cpp $ct" >&2
      "$LLAMA_BENCH" -m "$MODEL" -t "$THREADS" -p 0 -n "$NGEN" -d "$DEPTHS" -r 1 \
        -ctk "$ct" -ctv "$ct" -fa 1 -o csv 2>/dev/null > "$TMP/llama.$r.$ct" || true
      # the csv's avg_ts column, one row per depth, in the order given
      awk -F, -v ct="$ct" 'NR == 1 { for (i = 1; i <= NF; i++) { h = $i; gsub(/"/, "", h); if (h == "avg_ts") c = i } next }
                           c { v = $c; gsub(/"/, "", v); print "llama.cpp", ct, NR - 1, v }' \
        "$TMP/llama.$r.$ct" >> "$TMP/rows"
    done
  fi
done

echo
echo "model: $MODEL, $THREADS threads, median of $ROUNDS rounds, engines alternating"
sort -u "$TMP/weights" 2>/dev/null || true
if [ -n "$LLAMA_BENCH" ]; then echo "llama-bench: $LLAMA_BENCH"
else echo "no llama-bench (-l PATH, LLAMA_BENCH or PATH): kvarn's side only (llama.cpp is not built by this script)"; fi
grep -m1 "model name" /proc/cpuinfo 2>/dev/null | sed 's/.*: /cpu: /' || true
python3 - "$TMP/rows" "$DEPTHS" <<'PY'
import collections, statistics, sys
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    eng, cache, col, v = line.split()
    try:
        rows[(eng, cache, int(col))].append(float(v))
    except ValueError:
        pass
depths = sys.argv[2].split(",")
med = {k: statistics.median(v) for k, v in rows.items()}
kv = sorted({k[0] for k in med if k[0].startswith("kvarn")})
order = [(e, c) for e in kv for c in ("fp16", "int8", "kvarn_k4v2_g128")] + \
        [("llama.cpp", "f16"), ("llama.cpp", "q8_0"), ("llama.cpp", "q4_0")]
base = ("llama.cpp", "f16") if any(k[:2] == ("llama.cpp", "f16") for k in med) else (kv[0], "fp16")
print(f"{'engine':11} {'cache':16}" + "".join(f" {'d ' + d + ' tok/s':>14} {'x ' + base[0] + ' ' + base[1]:>16}" for d in depths))
for eng, cache in order:
    if not any(k[:2] == (eng, cache) for k in med):
        continue
    line = f"{eng:11} {cache:16}"
    for i in range(len(depths)):
        v, b = med.get((eng, cache, i + 1)), med.get(base + (i + 1,))
        line += f" {v:14.1f} {v / b:15.2f}x" if v and b else f" {'-':>14} {'-':>16}"
    print(line)
print("spread over the rounds (min-max tok/s):")
for eng, cache in order:
    if not any(k[:2] == (eng, cache) for k in med):
        continue
    print(f"{eng:11} {cache:16}" + "".join(
        f" {min(rows[(eng, cache, i + 1)]):7.1f}-{max(rows[(eng, cache, i + 1)]):<7.1f}"
        if rows.get((eng, cache, i + 1)) else f" {'-':>15}" for i in range(len(depths))))
PY
