/* emu_runtime.cpp -- the CUDA runtime calls src/cuda and tests/cuda use,
 * served on the CPU for the kernel emulation (cuda_emu.h): "device" memory
 * is host memory, copies are memcpy, every launch runs to completion before
 * it returns, and stream capture records launches for replay by
 * cudaGraphLaunch. One fake device with 132 SMs, compute capability 9.x. */
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

#include "cuda_emu.h"

thread_local kc_emu_dim kc_emu_thread_idx, kc_emu_block_idx;
kc_emu_dim kc_emu_grid_dim, kc_emu_block_dim;

namespace {

struct block_state {
    std::unique_ptr<std::barrier<>> block_bar;
    std::vector<std::unique_ptr<std::barrier<>>> warp_bar;
    std::vector<float> shfl;
    std::vector<unsigned> mma_a, mma_b; /* [warps * 32][4], [warps * 32][2] */
    std::vector<unsigned char> smem;
};
block_state *g_block = nullptr;

bool g_capturing = false;
std::vector<std::function<void()>> *g_capture = nullptr;

void run_launch(dim3 grid, unsigned block, size_t smem, const std::function<void()> &body)
{
    block_state st;
    st.block_bar = std::make_unique<std::barrier<>>((std::ptrdiff_t)block);
    const unsigned warps = (block + 31) / 32;
    for (unsigned w = 0; w < warps; w++) st.warp_bar.push_back(std::make_unique<std::barrier<>>(32));
    st.shfl.assign(warps * 32, 0.0f);
    st.mma_a.assign(warps * 32 * 4, 0u);
    st.mma_b.assign(warps * 32 * 2, 0u);
    st.smem.assign(smem + 16, 0);
    g_block = &st;
    kc_emu_grid_dim = {grid.x, grid.y, grid.z};
    kc_emu_block_dim = {block, 1, 1};
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                std::vector<std::thread> threads;
                threads.reserve(block);
                for (unsigned t = 0; t < block; t++)
                    threads.emplace_back([&, t]() {
                        kc_emu_thread_idx = {t, 0, 0};
                        kc_emu_block_idx = {x, y, z};
                        body();
                        /* a thread that returns early still counts at every
                         * later barrier of its block and warp */
                        st.block_bar->arrive_and_drop();
                        st.warp_bar[t / 32]->arrive_and_drop();
                    });
                for (auto &th : threads) th.join();
                /* fresh barriers for the next block (arrive_and_drop shrank them) */
                st.block_bar = std::make_unique<std::barrier<>>((std::ptrdiff_t)block);
                for (unsigned w = 0; w < warps; w++) st.warp_bar[w] = std::make_unique<std::barrier<>>(32);
            }
    g_block = nullptr;
}

} // namespace

void __syncthreads(void) { g_block->block_bar->arrive_and_wait(); }

float kc_emu_shfl_xor(float v, int lane_mask)
{
    const unsigned t = kc_emu_thread_idx.x, w = t / 32, lane = t % 32;
    g_block->shfl[w * 32 + lane] = v;
    g_block->warp_bar[w]->arrive_and_wait();
    const float r = g_block->shfl[w * 32 + (lane ^ (unsigned)lane_mask)];
    g_block->warp_bar[w]->arrive_and_wait();
    return r;
}

void kc_emu_mma_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2])
{
    const unsigned t = kc_emu_thread_idx.x, w = t / 32, lane = t % 32;
    unsigned *wa = &g_block->mma_a[w * 32 * 4], *wb = &g_block->mma_b[w * 32 * 2];
    for (int i = 0; i < 4; i++) wa[lane * 4 + i] = a[i];
    for (int i = 0; i < 2; i++) wb[lane * 2 + i] = b[i];
    g_block->warp_bar[w]->arrive_and_wait();
    auto bf = [](unsigned reg, int k) {
        const unsigned u = (k & 1 ? reg >> 16 : reg) & 0xffffu;
        float f;
        const unsigned x = u << 16;
        std::memcpy(&f, &x, 4);
        return f;
    };
    /* A[row][k]: lane (row % 8) * 4 + (k % 8) / 2, register (row >= 8) + 2 (k >= 8);
     * B[k][col]: lane col * 4 + (k % 8) / 2, register (k >= 8) */
    const int g = (int)lane / 4, c = (int)lane % 4;
    for (int i = 0; i < 4; i++) {
        const int row = g + (i >= 2 ? 8 : 0), col = 2 * c + (i & 1);
        float s = 0.0f;
        for (int k = 0; k < 16; k++) {
            const float x = bf(wa[((row % 8) * 4 + (k % 8) / 2) * 4 + (row >= 8) + 2 * (k >= 8)], k);
            const float y = bf(wb[(col * 4 + (k % 8) / 2) * 2 + (k >= 8)], k);
            s += x * y;
        }
        d[i] += s;
    }
    g_block->warp_bar[w]->arrive_and_wait();
}

void *kc_emu_dynamic_smem(void) { return g_block->smem.data(); }

void kc_emu_launch(dim3 grid, unsigned block, size_t smem, std::function<void()> body)
{
    if (g_capturing) {
        g_capture->push_back([=]() { run_launch(grid, block, smem, body); });
        return;
    }
    run_launch(grid, block, smem, body);
}

/* ------------------------------------------------------------ runtime */

extern "C" {

cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return cudaSuccess; }
cudaError_t cudaGetDevice(int *d) { *d = 0; return cudaSuccess; }
cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr attr, int)
{
    *v = attr == cudaDevAttrMultiProcessorCount      ? 132
         : attr == cudaDevAttrComputeCapabilityMajor ? 9 /* an H100/H200: bf16 mma */
                                                     : 0;
    return cudaSuccess;
}
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
cudaError_t cudaPeekAtLastError(void) { return cudaSuccess; }
const char *cudaGetErrorString(cudaError_t) { return "emulated"; }
cudaError_t cudaFuncSetAttribute(const void *, cudaFuncAttribute, int) { return cudaSuccess; }
cudaError_t cudaMalloc(void **p, size_t n)
{
    *p = aligned_alloc(256, (n + 255) / 256 * 256);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFree(void *p) { free(p); return cudaSuccess; }
cudaError_t cudaMemcpy(void *d, const void *s, size_t n, cudaMemcpyKind) { memcpy(d, s, n); return cudaSuccess; }
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind, cudaStream_t)
{
    memcpy(d, s, n);
    return cudaSuccess;
}
cudaError_t cudaMemset(void *d, int v, size_t n) { memset(d, v, n); return cudaSuccess; }
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaStreamCreate(cudaStream_t *s) { *s = reinterpret_cast<cudaStream_t>(new int(0)); return cudaSuccess; }
cudaError_t cudaStreamDestroy(cudaStream_t s) { delete reinterpret_cast<int *>(s); return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamBeginCapture(cudaStream_t, cudaStreamCaptureMode)
{
    g_capturing = true;
    g_capture = new std::vector<std::function<void()>>();
    return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t *g)
{
    g_capturing = false;
    *g = reinterpret_cast<cudaGraph_t>(g_capture);
    g_capture = nullptr;
    return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long)
{
    *e = reinterpret_cast<cudaGraphExec_t>(g);
    return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t)
{
    for (auto &f : *reinterpret_cast<std::vector<std::function<void()>> *>(e)) f();
    return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t) { return cudaSuccess; }
cudaError_t cudaGraphDestroy(cudaGraph_t g)
{
    delete reinterpret_cast<std::vector<std::function<void()>> *>(g);
    return cudaSuccess;
}

} // extern "C"
