#!/usr/bin/env bash
# run.sh -- run tests/cuda/test_cuda.c against src/cuda's kernels executed on
# the CPU (cuda_emu.h, emu_runtime.cpp), to check the kernels' logic where
# there is no GPU. Slow (one OS thread per GPU thread); sizes are reduced
# under KVARN_CUDA_EMULATED. Not part of the normal build or of CI.
# KVARN_TEST_FILTER=test_gpu_attention runs one test (cmocka's pattern);
# KVARN_EMU_BUILD names the build folder (default build-cuda-emu).
set -euo pipefail
cd "$(dirname "$0")/../../.."
b=${KVARN_EMU_BUILD:-build-cuda-emu}
inc="-Iinclude -Isrc -Itests -Itests/cuda/emu -I${CUDA_HOME:-/usr/local/cuda}/include"
mkdir -p "$b"
cmake -S . -B "$b/core" -DKVARN_CUDA=OFF -DKVARN_TESTS=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$b/core" -j2 --target kvarn_static >/dev/null
for f in api store commit attn attn_mma; do
  g++ -std=c++20 -O2 -g -DKC_EMULATE $inc -pthread -x c++ -c "src/cuda/$f.cu" -o "$b/$f.o" &
done
g++ -std=c++20 -O2 -g $inc -pthread -c tests/cuda/emu/emu_runtime.cpp -o "$b/emu_runtime.o" &
gcc -std=c11 -O2 -g -D_POSIX_C_SOURCE=200809L -DKVARN_HAVE_CUDA=1 -DKVARN_CUDA_EMULATED=1 $inc \
    -c tests/cuda/test_cuda.c -o "$b/test_cuda.o" &
wait
g++ -o "$b/test_cuda_emu" "$b"/api.o "$b"/store.o "$b"/commit.o "$b"/attn.o "$b"/attn_mma.o "$b"/emu_runtime.o \
    "$b"/test_cuda.o "$b/core/libkvarn.a" -lcmocka -lz -lm -pthread
"$b/test_cuda_emu" "$@"
