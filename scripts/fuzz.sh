#!/usr/bin/env bash
# fuzz.sh -- a libFuzzer campaign over the fuzz targets of tests/fuzz, run by
# hand (not part of scripts/test.sh, which replays the regression corpus in
# ctest instead).
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#
# TARGET: format (cache-format names and hostile record bytes), gguf,
# tokenizer, state (saved sequences, kvarn_cache_seq_restore); default all
# four, 300 seconds each, one after the other on one
# core. Needs clang and its libFuzzer runtime (Debian 12: apt-get install
# clang libclang-rt-14-dev) besides the build packages of scripts/setup.sh.
#
# Builds in build-fuzz/: the library sources compiled once with
# -fsanitize=fuzzer-no-link,address,undefined into an archive, each target
# linked with -fsanitize=fuzzer,address,undefined. Each run starts from
# tests/fuzz/corpus/TARGET (the committed regression inputs) and grows its
# working corpus in build-fuzz/corpus/TARGET; crashing inputs land in
# build-fuzz/crashes/TARGET/. Add each one to tests/fuzz/corpus/TARGET/ with
# the fix: the test_fuzz_TARGET ctest programs replay every file there.
# The last lines of each log (build-fuzz/TARGET.log) give executions and
# coverage; a summary line per target is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${1:-300}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(format gguf tokenizer state)
case "$secs" in ''|*[!0-9]*) echo "usage: scripts/fuzz.sh [SECONDS_PER_TARGET] [format|gguf|tokenizer|state]..." >&2; exit 2 ;; esac

CC=${CC:-clang}
command -v "$CC" >/dev/null || { echo "fuzz.sh: $CC not found (apt-get install clang libclang-rt-14-dev)" >&2; exit 1; }

out=build-fuzz
mkdir -p "$out/obj"
san="-fsanitize=address,undefined -fno-sanitize-recover=undefined"
cflags="-std=c11 -g -O1 -fno-omit-frame-pointer -D_POSIX_C_SOURCE=200809L -Iinclude -Isrc -Itests"
blas_inc=""
for d in /usr/include/x86_64-linux-gnu/openblas-pthread /usr/include/openblas; do
  [ -f "$d/cblas.h" ] && { blas_inc="-I$d"; break; }
done

# The library, instrumented for coverage but without libFuzzer's main.
objs=()
for src in src/common/*.c src/codec/*.c src/cache/*.c src/attn/*.c src/gguf/*.c src/tokenizer/*.c src/model/*.c; do
  [ -f "$src" ] || continue
  simd=""
  case "$src" in
    *_avx2.c) simd="-mavx2 -mfma -mf16c" ;;
    *_avx512.c) simd="-mavx512f -mavx512bw -mavx512vl -mavx2 -mfma -mf16c" ;;
  esac
  obj="$out/obj/$(echo "${src#src/}" | tr / _).o"
  if [ ! -f "$obj" ] || [ "$src" -nt "$obj" ]; then
    # shellcheck disable=SC2086
    $CC $cflags $blas_inc $san -fsanitize=fuzzer-no-link $simd -c "$src" -o "$obj"
  fi
  objs+=("$obj")
done
rm -f "$out/libkvarn_fuzz.a"
ar rcs "$out/libkvarn_fuzz.a" "${objs[@]}"

summary=()
for t in "${targets[@]}"; do
  src=tests/fuzz/fuzz_$t.c
  [ -f "$src" ] || { echo "fuzz.sh: no target '$t' ($src)" >&2; exit 2; }
  # shellcheck disable=SC2086
  $CC $cflags $san -fsanitize=fuzzer -DKVARN_LIBFUZZER "$src" "$out/libkvarn_fuzz.a" \
      -lopenblas -lpcre2-8 -lz -lm -lpthread -o "$out/fuzz_$t"
  mkdir -p "$out/corpus/$t" "$out/crashes/$t"
  seeds=()
  [ -d "tests/fuzz/corpus/$t" ] && seeds=("tests/fuzz/corpus/$t")
  echo "== fuzz_$t: $secs s" >&2
  set +e
  "$out/fuzz_$t" -max_total_time="$secs" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="$out/crashes/$t/" \
      "$out/corpus/$t" "${seeds[@]}" >"$out/$t.log" 2>&1
  rc=$?
  set -e
  done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$out/$t.log" | tail -1 || true)
  [ -n "$done_line" ] || done_line=$(grep -E '^#[0-9]+' "$out/$t.log" | tail -1 || true)
  execs=$(grep -E '^stat::number_of_executed_units' "$out/$t.log" | awk '{print $2}' || true)
  crashes=$(find "$out/crashes/$t" -type f | wc -l)
  summary+=("fuzz_$t: exit $rc, $execs executions, last status '$done_line', $crashes crashing input(s) in $out/crashes/$t")
done
printf '%s\n' "${summary[@]}"
