/* cuda_emu.h -- just enough of the CUDA device model to run src/cuda's
 * kernels on the CPU, for checking their logic on a machine without a GPU
 * (tests/cuda/emu/run.sh). Not a simulator of timing or of memory faults:
 * every GPU thread is an OS thread, __syncthreads is a barrier over the
 * thread block, a warp shuffle is an exchange through a buffer between two
 * barriers over the warp, thread blocks run one after another, and
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
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
using std::max;
using std::min;

void *kc_emu_dynamic_smem(void);
void kc_emu_launch(dim3 grid, unsigned block, size_t smem, std::function<void()> body);

#define KC_LAUNCH(kernel, grid, block, smem, stream, ...)                         \
    ((void)(stream), kc_emu_launch(dim3(grid), (unsigned)(block), (size_t)(smem), \
                                   [=]() { kernel(__VA_ARGS__); }))
#define KC_DYNAMIC_SMEM(type, name) type *name = static_cast<type *>(kc_emu_dynamic_smem())

#endif
