/*
 * common.cuh -- what the CUDA kernels share: the device view of one layer's
 * paged cache (offsets from include/kvarn/record.h, computed once on the
 * host), number conversions, code unpacking, the warp-level fast
 * Walsh-Hadamard transform,
 * and the launchers each kernel file exports to src/cuda/api.cu.
 * Internal to src/cuda.
 */
#ifndef KVARN_CUDA_COMMON_CUH
#define KVARN_CUDA_COMMON_CUH

#include <stddef.h>
#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "cuda/dispatch.h"
#include "kvarn/kvarn.h"
#include "kvarn/paged.h"

/* Kernel launch and dynamic shared memory, spelled through macros so that
 * tests/cuda/emu can run the same kernels on the CPU (KC_EMULATE). */
#ifdef KC_EMULATE
#include "cuda_emu.h"
#else
#define KC_LAUNCH(kernel, grid, block, smem, stream, ...) \
    kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
#define KC_DYNAMIC_SMEM(type, name) extern __shared__ type name[]
#endif

/* Device view of one layer's paged cache plus its record layout: the
 * caller's kvarn_paged_kv (include/kvarn/paged.h; every address through its
 * helpers), its geometry as plain ints for the dispatch tables, and the byte
 * offsets inside one record (KVarN) or one token record (per-token), filled
 * from kvarn_record_layout_get so that no kernel does its own layout sums. */
struct kc_geom {
    kvarn_paged_kv kv;
    int kind, D, G, Hk, key_bits, value_bits;
    int k_codes_off, k_a_off, k_b_off, k_stok_off;
    int v_codes_off, v_schan_off, v_a_off, v_b_off;
    int payload_bytes, record_bytes; /* of one record (one token record) */
};

/* One attention call, as every attention kernel reads it. */
struct kc_attn {
    kc_geom g;
    const float *q;
    float *out;
    const int32_t *block_tables, *seq_lens, *committed_tiles, *query_start_loc;
    int max_blocks, Hq, group_size, row_chunks, num_splits, window;
    float scale_log2; /* softmax_scale * log2(e): scores are kept in base 2 */
    float *ws;        /* split-K partials, NULL when num_splits == 1 */
    const float *sinks; /* [Hq] learned sink logits (natural log), NULL: none */
    int matrix;         /* 1: the tensor-core kernel (attn_mma.cu) takes the call's
                           sequences of KVARN_CUDA_MMA_MIN_QUERIES queries or more */
};

/* The factor that turns a row's unnormalized accumulator into its output:
 * 1 / l, or with a learned sink s (natural log; -inf: none) of the row's
 * query head, merged as one more (max, sum) part with no value (base 2
 * like m and l: sb = s log2(e)): M = max(m, sb), 2^(m - M) / (l 2^(m - M) +
 * 2^(sb - M)). 0 for a row that saw no key. attn.h kvarn_attn_opts.sinks;
 * the CPU driver's finish_row (src/attn/attn.c) does the same. */
__device__ __forceinline__ float kc_out_scale(const float *sinks, int head, float m, float l)
{
    const float sb = sinks != nullptr ? sinks[head] * 1.4426950408889634f : -INFINITY;
    if (sb == -INFINITY) return l > 0.0f ? 1.0f / l : 0.0f;
    const float M = l > 0.0f && m > sb ? m : sb;
    const float w = l > 0.0f ? exp2f(m - M) : 0.0f;
    return w / (l * w + exp2f(sb - M));
}

/* Launchers (one per kernel file). Each returns cudaErrorInvalidValue when
 * no kernel is compiled for the geometry, else the launch's error. */
cudaError_t kc_launch_store(const kc_geom &g, int dtype, const void *k, const void *v,
                            const int64_t *slots, int num_tokens, cudaStream_t s);
cudaError_t kc_launch_commit(const kc_geom &g, const int32_t *src_pages,
                             const int32_t *dst_blocks, int num_tiles, int iters,
                             cudaStream_t s);
cudaError_t kc_launch_attn(const kc_attn &a, int num_seqs, cudaStream_t s);
/* attn_mma.cu: the main kernel only, for the sequences with at least
 * KVARN_CUDA_MMA_MIN_QUERIES queries (kc_launch_attn adds the vector kernel
 * for the others and the split-K merge); and whether the code this device
 * runs of it was built for compute capability 8.0 or later (host). */
cudaError_t kc_launch_attn_mma(const kc_attn &a, int num_seqs, cudaStream_t s);
bool kc_attn_mma_compiled(void);

/* Floats of one split-K partial entry: m[ROWS], l[ROWS], acc[ROWS][D]. */
__host__ __device__ inline size_t kc_partial_floats(int D)
{
    return (size_t)KVARN_CUDA_ROWS * (size_t)(D + 2);
}

/* ------------------------------------------------------------ numbers */

__device__ __forceinline__ float kc_h2f(uint16_t h)
{
    return __half2float(__ushort_as_half(h));
}

__device__ __forceinline__ float kc_bf2f(uint16_t h)
{
    return __uint_as_float((uint32_t)h << 16);
}

__device__ __forceinline__ uint16_t kc_f2h(float x)
{
    return __half_as_ushort(__float2half_rn(x));
}

__device__ __forceinline__ uint16_t kc_f2bf(float x)
{
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

__device__ __forceinline__ uint16_t kc_ld16(const uint8_t *p)
{
    return *reinterpret_cast<const uint16_t *>(p);
}

__device__ __forceinline__ uint32_t kc_ld32(const uint8_t *p)
{
    return *reinterpret_cast<const uint32_t *>(p);
}

/* D += A . B on the tensor cores, one warp: mma.sync m16n8k16, A 16 x 16
 * bf16 (row), B 16 x 8 bf16 (col), D 16 x 8 fp32, in the PTX ISA's fragment
 * layout (g = lane / 4, c = lane % 4): a[0] = A[g][2c, 2c+1], a[1] =
 * A[g+8][2c, 2c+1], a[2] = A[g][2c+8, 2c+9], a[3] = A[g+8][2c+8, 2c+9];
 * b[0] = B[2c, 2c+1][g], b[1] = B[2c+8, 2c+9][g]; d = D[g][2c, 2c+1],
 * D[g+8][2c, 2c+1]; the lower-numbered element in the low 16 bits.
 * Compute capability 8.0 or later; tests/cuda/emu emulates it. */
__device__ __forceinline__ void kc_mma_bf16(float (&d)[4], const uint32_t (&a)[4],
                                            const uint32_t (&b)[2])
{
#if defined(KC_EMULATE)
    kc_emu_mma_bf16(d, a, b);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(__CUDA_ARCH__)
    __trap(); /* never launched below 8.0 (api.cu asks the device) */
#endif
}

/* 8 codes of `B` bits starting at p (low bits first), as floats. */
template <int B>
__device__ __forceinline__ void kc_load_codes8(const uint8_t *p, float (&c)[8])
{
    if (B == 2) {
        const uint32_t u = kc_ld16(p);
#pragma unroll
        for (int e = 0; e < 8; e++) c[e] = (float)((u >> (2 * e)) & 3u);
    } else if (B == 4) {
        const uint32_t u = kc_ld32(p);
#pragma unroll
        for (int e = 0; e < 8; e++) c[e] = (float)((u >> (4 * e)) & 15u);
    } else {
        const uint32_t u0 = kc_ld32(p), u1 = kc_ld32(p + 4);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            c[e] = (float)((u0 >> (8 * e)) & 255u);
            c[e + 4] = (float)((u1 >> (8 * e)) & 255u);
        }
    }
}

/* ------------------------------------------------------------ Hadamard */

/* In-place normalized Walsh-Hadamard transform (natural order, times
 * 1/sqrt(D)) of one D-vector spread over a warp: lane l holds elements
 * [l*E, l*E + E), E = D / 32. Butterflies of stride < E stay in the lane,
 * wider ones pair lanes by shuffle. ../shared/spec/KVARN.md step 1. */
template <int D>
__device__ __forceinline__ void kc_warp_fwht(float (&x)[D / 32])
{
    constexpr int E = D / 32;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int s = 1; s < E; s <<= 1) {
#pragma unroll
        for (int e = 0; e < E; e++) {
            if ((e & s) == 0) {
                float a = x[e], b = x[e + s];
                x[e] = a + b;
                x[e + s] = a - b;
            }
        }
    }
#pragma unroll
    for (int ls = 1; ls < 32; ls <<= 1) {
        const bool upper = (lane & ls) != 0;
#pragma unroll
        for (int e = 0; e < E; e++) {
            float o = __shfl_xor_sync(0xffffffffu, x[e], ls);
            x[e] = upper ? o - x[e] : x[e] + o;
        }
    }
    /* 1/sqrt(D) rounded once to fp32 (exact for 64 and 256). */
    const float norm = D == 64    ? 0.125f
                       : D == 256 ? 0.0625f
                       : D == 512 ? 0.04419417382415922f
                                  : 0.08838834764831845f;
    static_assert(D == 64 || D == 128 || D == 256 || D == 512, "head_dim");
#pragma unroll
    for (int e = 0; e < E; e++) x[e] *= norm;
}

__device__ __forceinline__ float kc_warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float kc_warp_max(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float kc_warp_min(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* ------------------------------------------------------------ attention rows */

/* Row bookkeeping both attention kernels share (attn.cu, attn_mma.cu). A
 * row is one query head of a KV head's GQA group for one query: row rr of
 * a sequence's nq queries is query rr / gs, head hk * gs + rr % gs. */

/* The key positions [*lo, *hi) row rr of a sequence of seq_len tokens (its
 * last nq the queries) may see: causal, and the sliding window. */
__device__ __forceinline__ void kc_row_keys(const kc_attn &a, int seq_len, int nq, int rr,
                                            int *lo, int *hi)
{
    const int qpos = seq_len - nq + rr / a.group_size;
    int h = min(qpos + 1, seq_len);
    const int l = a.window > 0 ? max(0, qpos - a.window + 1) : 0;
    *lo = l;
    *hi = h < l ? l : h;
}

/* Row rr's query (queries q0.. of the sequence, KV head hk) times
 * softmax_scale * log2(e), rotated by H/sqrt(D) for KVarN (rot); lane l
 * holds elements [l E, l E + E), E = D / 32. The multiply is not
 * contracted into the rotation's first butterfly, so the fp32 result is
 * the CPU's rotation of the same products. */
template <int D>
__device__ __forceinline__ void kc_load_query(const kc_attn &a, int q0, int hk, int rr, bool rot,
                                              float (&x)[D / 32])
{
    constexpr int E = D / 32;
    const int lane = threadIdx.x & 31, head = hk * a.group_size + rr % a.group_size;
    const float *qp = a.q + ((size_t)(q0 + rr / a.group_size) * a.Hq + head) * D + (size_t)lane * E;
#pragma unroll
    for (int e = 0; e < E; e++) x[e] = __fmul_rn(qp[e], a.scale_log2);
    if (rot) kc_warp_fwht<D>(x);
}

/* Write row rr's output, lane l's elements [l E, l E + E) of x (rotated
 * back first for KVarN: rot). */
template <int D>
__device__ __forceinline__ void kc_store_out(const kc_attn &a, int q0, int hk, int rr, bool rot,
                                             float (&x)[D / 32])
{
    constexpr int E = D / 32;
    const int lane = threadIdx.x & 31, head = hk * a.group_size + rr % a.group_size;
    if (rot) kc_warp_fwht<D>(x);
    float *op = a.out + ((size_t)(q0 + rr / a.group_size) * a.Hq + head) * D + (size_t)lane * E;
#pragma unroll
    for (int e = 0; e < E; e++) op[e] = x[e];
}

/* This split's tiles [*b, *e) of the tiles holding key positions [ulo,
 * uhi) (the union over a thread block's rows), G tokens a tile. */
__device__ __forceinline__ void kc_split_tiles(const kc_attn &a, int ulo, int uhi, int G, int split,
                                               int *b, int *e)
{
    const int tb = ulo / G, te = min((uhi + G - 1) / G, a.max_blocks);
    const int per = (te - tb + a.num_splits - 1) / a.num_splits;
    *b = tb + split * per;
    *e = min(te, *b + per);
}

#endif
