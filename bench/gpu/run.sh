#!/usr/bin/env bash
# run.sh -- every GPU check and timing of the CUDA backend, in one script
# (docs/gpu-notes.md says what the numbers mean).
#
#   bench/gpu/run.sh [--dry-run] [--quick] [--dump FILE] [--formats "F ..."]
#                    [--batches "1 8 64"] [--ctxs "4096 32768 131072"]
#                    [--iters N] [--out DIR]
#
# On a GPU machine:
#   1. builds with CUDA (build-gpu/, CMAKE_CUDA_ARCHITECTURES from
#      $KVARN_CUDA_ARCH, default 90-real: one arch is enough there);
#   2. runs tests/cuda/test_cuda (random tiles: store/commit against the CPU
#      encoder, attention against a double reference);
#   3. if a K/V dump exists (--dump, or $KVARN_KV_DUMP; format in
#      docs/kv-dump.md), runs the same checks on it for each KVarN preset;
#   4. times decode attention (Llama-3-8B shapes: 32 query heads, 8 KV heads,
#      D = 128) for every format, batch and context with CUDA events, next to
#      a device-to-device copy of the bytes read and PyTorch's fp16 SDPA over
#      unpaged K/V, and prints the ratios; then prefill chunks of 512 and
#      2,048 queries (KVarN presets, contexts up to 32k) on the tensor-core
#      kernel and on the vector kernel (prefill.csv).
# Results go to --out (default $OUT/gpu if $OUT is set, else build-gpu/results).
#
# --dry-run: what can run without a GPU: builds (nvcc if present, else the
# CPU library only), checks the arguments, prints the plan (split-K,
# workspace, bytes per decode step and the time they take at 4.8 TB/s).
set -euo pipefail
cd "$(dirname "$0")/../.."

dry=0
dump="${KVARN_KV_DUMP:-}"
formats="kvarn_k4v2_g128 kvarn_k4v4_g128 int8 int4 fp8_e4m3 fp16"
batches="1 8 64"
ctxs="4096 32768 131072"
iters=50
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1; shift ;;
    --quick) batches="1 8"; ctxs="4096 32768"; iters=20; shift ;;
    --dump) dump="${2:?--dump needs a file}"; shift 2 ;;
    --formats) formats="${2:?}"; shift 2 ;;
    --batches) batches="${2:?}"; shift 2 ;;
    --ctxs) ctxs="${2:?}"; shift 2 ;;
    --iters) iters="${2:?}"; shift 2 ;;
    --out) out="${2:?}"; shift 2 ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$out" ]; then
  if [ -n "${OUT:-}" ]; then out="$OUT/gpu"; else out="build-gpu/results"; fi
fi

# -- argument checks (both modes)
for n in $batches $ctxs $iters; do
  case "$n" in ''|*[!0-9]*) echo "run.sh: '$n' is not a positive integer" >&2; exit 2 ;; esac
  [ "$n" -gt 0 ] || { echo "run.sh: '$n' must be > 0" >&2; exit 2; }
done
if [ -n "$dump" ] && [ ! -f "$dump" ]; then
  echo "run.sh: dump '$dump' not found; the dump checks will be skipped" >&2
  dump=""
fi
if [ -n "$dump" ]; then
  python3 - "$dump" <<'EOF' || { echo "run.sh: '$dump' is not a KV dump (docs/kv-dump.md)" >&2; exit 2; }
import struct, sys, os
p = sys.argv[1]
with open(p, "rb") as f:
    h = f.read(64)
magic, ver, L, T, H, D, dt, flags = struct.unpack("<8s7I", h[:36])
assert magic == b"KVDUMP1\0" and ver == 1 and dt == 0 and min(L, T, H, D) > 0
need = 64 + 2 * L * T * H * D * 4
assert os.path.getsize(p) >= need, "truncated"
print(f"dump {p}: {L} layers, {T} tokens, {H} KV heads, head_dim {D}")
EOF
fi

# -- build
have_nvcc=0
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then have_nvcc=1; fi
arch="${KVARN_CUDA_ARCH:-90-real}"
jobs=$(nproc 2>/dev/null || echo 2)
echo "== build (build-gpu, CUDA architectures $arch, nvcc: $have_nvcc)" >&2
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DKVARN_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="$arch" >/dev/null
if [ "$have_nvcc" = 1 ]; then
  cmake --build build-gpu -j"$jobs" --target test_cuda gpu_bench
else
  cmake --build build-gpu -j"$jobs" --target kvarn_static
fi

if [ "$dry" = 1 ]; then
  echo "== dry run: plan (no GPU used)"
  echo "steps: test_cuda (random tiles); dump checks: ${dump:-none}; timings below; PyTorch SDPA fp16 baseline"
  echo "shapes: 32 query heads, 8 KV heads, D=128; batches: $batches; contexts: $ctxs; $iters timed runs each"
  if [ "$have_nvcc" = 1 ]; then
    for f in $formats; do
      for b in $batches; do
        for c in $ctxs; do
          ./build-gpu/gpu_bench plan --format "$f" --batch "$b" --ctx "$c" || {
            echo "run.sh: format '$f' is not served by the CUDA backend" >&2; exit 2; }
        done
      done
    done
  else
    echo "(no nvcc here: the CUDA backend is not built, so no per-shape plan)"
  fi
  if ./build-gpu/test_cuda >/dev/null 2>&1; then echo "test_cuda (host-side checks): passed"; fi
  echo "== dry run done"
  exit 0
fi

[ "$have_nvcc" = 1 ] || { echo "run.sh: nvcc not found" >&2; exit 2; }
mkdir -p "$out"
nvidia-smi -L | tee "$out/device.txt" || true
nvcc --version | tail -2 >> "$out/device.txt" || true

status=0
echo "== random-tile checks (test_cuda)" >&2
./build-gpu/test_cuda 2>&1 | tee "$out/test_cuda.log" || status=1

if [ -n "$dump" ]; then
  echo "== K/V dump checks ($dump)" >&2
  : > "$out/dump_checks.log"
  for f in kvarn_k4v2_g128 kvarn_k4v4_g128 kvarn_k4v2_g64 int8; do
    ./build-gpu/gpu_bench dump --dump "$dump" --format "$f" --layers 4 2>&1 | tee -a "$out/dump_checks.log" || status=1
  done
else
  echo "== no K/V dump: dump checks skipped (kvarn eval --dump-kv, docs/kv-dump.md)" >&2
fi

echo "== timings" >&2
csv="$out/timings.csv"
echo "kind,format,batch,ctx,splits,ms,bytes_read,GBps,copy_ms" > "$csv"
for f in $formats; do
  for b in $batches; do
    for c in $ctxs; do
      ./build-gpu/gpu_bench time --format "$f" --batch "$b" --ctx "$c" --iters "$iters" | tee -a "$csv" || status=1
    done
  done
done
echo "== prefill chunks: tensor-core kernel against the vector kernel (KVARN_CUDA_MATRIX=0)" >&2
pcsv="$out/prefill.csv"
echo "kind,format,batch,ctx,queries,splits,matrix_ms,vector_ms,vector_over_matrix" > "$pcsv"
for f in kvarn_k4v2_g128 kvarn_k4v4_g128; do
  for c in $ctxs; do
    [ "$c" -gt 32768 ] && continue
    for qn in 512 2048; do
      ./build-gpu/gpu_bench time --format "$f" --batch 1 --ctx "$c" --queries "$qn" --iters "$iters" \
        | tee -a "$pcsv" || status=1
    done
  done
done
# shellcheck disable=SC2086
python3 bench/gpu/sdpa_baseline.py --batches $batches --ctxs $ctxs --iters "$iters" \
  | awk -F, '{print $1","$2","$3","$4",,"$5","$6","$7","}' | tee -a "$csv" || status=1

echo "== ratios" >&2
python3 - "$csv" <<'EOF' | tee "$out/ratios.txt"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
sdpa = {(r["batch"], r["ctx"]): float(r["ms"]) for r in rows if r["kind"] == "sdpa"}
print(f"{'format':18} {'batch':>5} {'ctx':>7} {'ms':>9} {'GB/s':>7} {'attn/copy':>9} {'SDPA fp16/attn':>14}")
for r in rows:
    if r["kind"] != "time":
        continue
    key = (r["batch"], r["ctx"])
    ms = float(r["ms"])
    ratio = f"{sdpa[key] / ms:.2f}x" if key in sdpa else "n/a"
    print(f"{r['format']:18} {r['batch']:>5} {r['ctx']:>7} {ms:9.4f} {float(r['GBps']):7.0f} "
          f"{ms / float(r['copy_ms']):9.2f} {ratio:>14}")
EOF
exit $status
