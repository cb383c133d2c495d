#!/usr/bin/env bash
# test.sh -- the whole test suite on a fresh machine: installs what it needs,
# builds, runs the C unit tests (plain and ASan+UBSan builds), the attention
# tests under ThreadSanitizer, the Python tests against the real model, and
# the vLLM plug-in tests on vLLM's CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)

# Stage times: each stage's wall time is printed at the end (also when a
# stage fails), with a warning for a stage past its share of the 45-minute
# budget on a 2-core host (docs/testing.md "Where the time goes"). A
# warning fails nothing: it says where to look before CI's limit is near.
stage_names=()
stage_secs=()
stage_share=()
stage_name=""
stage_t0=$SECONDS
stage() { # stage NAME SHARE_SECONDS: ends the running stage, starts NAME
  stage_end
  stage_name=$1
  stage_cur_share=$2
  stage_t0=$SECONDS
  echo "== $1" >&2
}
stage_end() {
  [ -n "$stage_name" ] || return 0
  stage_names+=("$stage_name")
  stage_secs+=($((SECONDS - stage_t0)))
  stage_share+=("$stage_cur_share")
  stage_name=""
}
stage_report() {
  local rc=${1:-$?} total=0 i note last
  stage_end
  last=$((${#stage_names[@]} - 1))
  echo "== stage times (wall; share = the stage's part of 45 min on 2 cores)" >&2
  for i in "${!stage_names[@]}"; do
    total=$((total + stage_secs[i]))
    note=""
    [ "$rc" -eq 0 ] || [ "$i" -ne "$last" ] || note="  FAILED (exit $rc)"
    printf '  %-44s %5d s  (share %4d s)%s\n' "${stage_names[i]}" "${stage_secs[i]}" \
      "${stage_share[i]}" "$note" >&2
  done
  printf '  %-44s %5d s  (budget 2700 s)\n' "total" "$total" >&2
  for i in "${!stage_names[@]}"; do
    if [ "${stage_secs[i]}" -gt "${stage_share[i]}" ]; then
      echo "test.sh: WARNING: '${stage_names[i]}' took ${stage_secs[i]} s, past its share of" \
           "${stage_share[i]} s (docs/testing.md \"Where the time goes\")" >&2
    fi
  done
  [ "$total" -le 2700 ] ||
    echo "test.sh: WARNING: the suite took $total s, past its 2700 s budget" >&2
  return $rc
}
trap stage_report EXIT

stage "set-up: Debian and Python packages, model, text" 180
bash scripts/setup.sh --deps --model

stage "release build + tests" 150
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
stage "release tests over the configuration matrix" 150
for cfg in "${matrix[@]}"; do
  echo "== release tests with $cfg" >&2
  env $cfg ctest --test-dir build --output-on-failure -j"$jobs"
done

stage "ASan + UBSan build + tests" 300
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DKVARN_SANITIZE=ON -DKVARN_CUDA=OFF >/dev/null
cmake --build build-asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1 ctest --test-dir build-asan --output-on-failure -j"$jobs"

stage "ThreadSanitizer build + attention tests" 240
cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DKVARN_TSAN=ON -DKVARN_CUDA=OFF >/dev/null
tsan_tests=$(for f in tests/attn/test_*.c; do basename "$f" .c; done)
# shellcheck disable=SC2086
cmake --build build-tsan -j"$jobs" --target $tsan_tests
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
  ctest --test-dir build-tsan --output-on-failure --no-tests=error -j"$jobs" \
        -R "^($(echo "$tsan_tests" | paste -sd'|' -))(\\.[0-9]+)?\$"

# The Python and vLLM tests: one pytest-xdist worker per core, each keeping
# to its own core (pytest_configure in tests/cli/conftest.py and
# tests/vllm/conftest.py), whole test files per worker (--dist loadfile: a
# file's module fixtures, and its launcher and engines, stay in one
# process); a single core runs one session as before.
xdist=()
[ "$jobs" -lt 2 ] || xdist=(-n "$jobs" --dist loadfile)
# The vLLM plug-in (python/kvarn_vllm) on vLLM's CPU build, end to end on the
# converted model: .venv-vllm is installed the first time (docs/vllm.md),
# in the background while the Python tests run (it mostly downloads and
# unpacks; nothing in tests/cli reads what it writes). Its log is printed
# after them; a failure of it fails the suite there.
vllm_log=$(mktemp)
(trap - EXIT; exec bash scripts/setup.sh --vllm) >"$vllm_log" 2>&1 &
vllm_setup=$!
trap 'rc=$?; kill "$vllm_setup" 2>/dev/null || true; stage_report "$rc" || true' EXIT
if ls tests/cli/test_*.py >/dev/null 2>&1; then
  stage "Python tests (real model; vLLM set-up beside)" 480
  python3 -m pytest -q --durations=15 "${xdist[@]}" tests/cli
fi
stage "vLLM set-up (.venv-vllm, converted model): the rest" 240
vllm_rc=0
wait "$vllm_setup" || vllm_rc=$?
cat "$vllm_log" >&2
rm -f "$vllm_log"
[ "$vllm_rc" -eq 0 ] || { echo "test.sh: scripts/setup.sh --vllm failed (exit $vllm_rc)" >&2
                          exit "$vllm_rc"; }
stage "vLLM plug-in tests (tests/vllm)" 960
.venv-vllm/bin/python -m pytest -q --durations=25 "${xdist[@]}" tests/vllm
