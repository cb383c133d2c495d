/* cuda_emu.h -- just enough of the CUDA device model to run src/cuda's
 * kernels on the CPU, for checking their logic on a machine without a GPU
 * (tests/cuda/emu/run.sh). Not a simulator of timing or of memory faults:
 * every GPU thread is an OS thread, __syncthreads is a barrier over the
 * thread block, a warp shuffle is an exchange through a buffer between two
 * barriers over the warp, a tensor-core mma a warp collective of the same
 * kind, thread blocks run one after another, and
 * __shared__ variables are function statics (one block at a time).
 * Included by src/cuda/common.cuh when KC_EMULATE is defined, after the
 * CUDA headers; compiled by g++ as C++20. */
#ifndef KVARN_CUDA_EMU_H
#define KVARN_CUDA_EMU_H

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#undef __device__
#undef __global__
#undef __shared__
#undef __forceinline__
#define __device__
#define __global__
#define __shared__ static
#define __forceinline__ inline
#define __launch_bounds__(...)

struct kc_emu_dim { unsigned x, y, z; };
extern thread_local kc_emu_dim kc_emu_thread_idx, kc_emu_block_idx;
extern kc_emu_dim kc_emu_grid_dim, kc_emu_block_dim;
#define threadIdx kc_emu_thread_idx
#define blockIdx kc_emu_block_idx
#define gridDim kc_emu_grid_dim
#define blockDim kc_emu_block_dim

void __syncthreads(void);
float kc_emu_shfl_xor(float v, int lane_mask);
static inline float __shfl_xor_sync(unsigned, float v, int m) { return kc_emu_shfl_xor(v, m); }
/* mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, d += a . b, a warp
 * collective: every lane posts its fragments, then computes its own four
 * outputs from all of them in the PTX ISA's layout (common.cuh
 * kc_mma_bf16); bf16 products exact in fp32, summed in k order. */
void kc_emu_mma_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]);
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __fmul_rn(float a, float b) { return a * b; } /* g++ -O2: no contraction on x86-64 without FMA */
using std::max;
using std::min;

void *kc_emu_dynamic_smem(void);
void kc_emu_launch(dim3 grid, unsigned block, size_t smem, std::function<void()> body);

#define KC_LAUNCH(kernel, grid, block, smem, stream, ...)                         \
    ((void)(stream), kc_emu_launch(dim3(grid), (unsigned)(block), (size_t)(smem), \
                                   [=]() { kernel(__VA_ARGS__); }))
#define KC_DYNAMIC_SMEM(type, name) type *name = static_cast<type *>(kc_emu_dynamic_smem())

#endif
