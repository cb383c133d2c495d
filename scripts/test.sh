#!/usr/bin/env bash
# test.sh -- the whole test suite on a fresh machine: installs what it needs,
# builds, runs the C unit tests (plain and ASan+UBSan builds), the attention
# tests under ThreadSanitizer, the Python tests against the real model, and
# the vLLM plug-in tests on vLLM's CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)

bash scripts/setup.sh --deps --model

echo "== release build + tests" >&2
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$jobs"
ctest --test-dir build --output-on-failure -j"$jobs"

# The configuration matrix (docs/testing.md): the Release tests again with the
# SIMD kernels capped (KVARN_SIMD, read by the library), the attention worker
# count of the tests (KVARN_TEST_THREADS, read by the tests only), OpenBLAS's
# thread count, and OpenBLAS's GEMM kernels forced to other CPUs' (generic
# SSE3 "Prescott", AVX2 "Haswell"), which is how results differ between
# machines. Not a full product (3 x 3 x 2 x 3): each value appears at least
# once, each run ~12 s.
matrix=("KVARN_SIMD=scalar KVARN_TEST_THREADS=1 OPENBLAS_NUM_THREADS=1"
        "KVARN_SIMD=avx2 KVARN_TEST_THREADS=2 OPENBLAS_NUM_THREADS=2")
if [ "$(uname -m)" = x86_64 ]; then
  matrix+=("KVARN_TEST_THREADS=3 OPENBLAS_NUM_THREADS=1 OPENBLAS_CORETYPE=Prescott")
  grep -qw avx2 /proc/cpuinfo &&
    matrix+=("KVARN_SIMD=scalar KVARN_TEST_THREADS=2 OPENBLAS_NUM_THREADS=2 OPENBLAS_CORETYPE=Haswell")
fi
for cfg in "${matrix[@]}"; do
  echo "== release tests with $cfg" >&2
  env $cfg ctest --test-dir build --output-on-failure -j"$jobs"
done

echo "== ASan + UBSan build + tests" >&2
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DKVARN_SANITIZE=ON -DKVARN_CUDA=OFF >/dev/null
cmake --build build-asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1 ctest --test-dir build-asan --output-on-failure -j"$jobs"

echo "== ThreadSanitizer build + attention tests (tests/attn: kernels, thread pool, split-K)" >&2
cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DKVARN_TSAN=ON -DKVARN_CUDA=OFF >/dev/null
tsan_tests=$(for f in tests/attn/test_*.c; do basename "$f" .c; done)
# shellcheck disable=SC2086
cmake --build build-tsan -j"$jobs" --target $tsan_tests
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
  ctest --test-dir build-tsan --output-on-failure --no-tests=error -j"$jobs" \
        -R "^($(echo "$tsan_tests" | paste -sd'|' -))\$"

if ls tests/python/test_*.py >/dev/null 2>&1; then
  echo "== Python tests (real model)" >&2
  python3 -m pytest -q --durations=15 tests/python
fi

# The vLLM plug-in (python/kvarn_vllm) on vLLM's CPU build, end to end on the
# converted model: installs .venv-vllm the first time (docs/vllm.md).
echo "== vLLM plug-in tests (tests/vllm)" >&2
bash scripts/setup.sh --vllm
.venv-vllm/bin/python -m pytest -q --durations=25 tests/vllm
