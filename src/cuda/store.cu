/*
 * store.cu -- the store kernel: K/V of freshly computed tokens into the
 * paged cache, addressed by the slot mapping (include/kvarn/attn.h).
 *   KVarN: rotate each token-head by H/sqrt(D) and write fp16 into the
 *          staging page row (../shared/spec/KVARN.md "The fp16 tail").
 *   per-token formats: encode the token record in place, bit for bit as
 *          src/codec/per_token.c does (fp16 scale rounded up, zero-point
 *          rounded down, codes against the rounded values).
 * One thread block per (token, KV head); warp 0 handles K, warp 1 V; lane l
 * holds channels [l*E, l*E + E), E = D / 32.
 */
#include "cuda/common.cuh"

namespace {

/* Smallest fp16 >= x for finite x >= 0 (per_token.c fp16_round_up). */
__device__ uint16_t fp16_round_up(float x)
{
    uint16_t h = kc_f2h(x);
    if ((h & 0x7c00u) != 0x7c00u && kc_h2f(h) < x) h++;
    return h;
}

/* Largest fp16 <= x for finite x (per_token.c fp16_round_down). */
__device__ uint16_t fp16_round_down(float x)
{
    uint16_t h = kc_f2h(x);
    if ((h & 0x7c00u) != 0x7c00u && kc_h2f(h) > x) {
        if (h & 0x8000u) h++;
        else h--;
    }
    if (h == 0x8000u) h = 0;
    return h;
}

__device__ __forceinline__ void put16(uint8_t *p, uint16_t v)
{
    *reinterpret_cast<uint16_t *>(p) = v;
}

template <int D>
__global__ void __launch_bounds__(64)
store_kernel(kc_geom g, int dtype, const void *k, const void *v, const int64_t *slots)
{
    constexpr int E = D / 32;
    const int tok = blockIdx.x, h = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t slot = slots[tok];
    if (slot < 0) return; /* padding */
    const int64_t id = slot / g.G;
    const int off = (int)(slot % g.G);
    if (id >= (g.kind == KVARN_KIND_KVARN ? g.kv.n_fp16_pages : g.kv.n_blocks)) return;

    const uint16_t *src = static_cast<const uint16_t *>(warp == 0 ? k : v) +
                          ((size_t)tok * g.Hk + h) * D + (size_t)lane * E;
    float x[E];
#pragma unroll
    for (int e = 0; e < E; e++) x[e] = dtype == 1 ? kc_bf2f(src[e]) : kc_h2f(src[e]);

    if (g.kind == KVARN_KIND_KVARN) {
        kc_warp_fwht<D>(x);
        uint16_t *dst = (warp == 0 ? kvarn_paged_page_k(&g.kv, (int32_t)id, h)
                                   : kvarn_paged_page_v(&g.kv, (int32_t)id, h)) +
                        (size_t)off * D + (size_t)lane * E;
#pragma unroll
        for (int e = 0; e < E; e++) dst[e] = kc_f2h(x[e]);
        return;
    }

    uint8_t *rec = kvarn_paged_token_record(&g.kv, (int32_t)id, h, off);
    uint8_t *codes = rec + (warp == 0 ? g.k_codes_off : g.v_codes_off);
    uint8_t *pa = rec + (warp == 0 ? g.k_a_off : g.v_a_off);
    uint8_t *pb = rec + (warp == 0 ? g.k_b_off : g.v_b_off);

    switch (g.kind) {
    case KVARN_KIND_FP16:
    case KVARN_KIND_BF16:
#pragma unroll
        for (int e = 0; e < E; e++)
            put16(codes + 2 * (lane * E + e), g.kind == KVARN_KIND_BF16 ? kc_f2bf(x[e]) : kc_f2h(x[e]));
        break;
    case KVARN_KIND_FP8_E4M3:
    case KVARN_KIND_FP8_E5M2: {
        const float fmax = g.kind == KVARN_KIND_FP8_E4M3 ? 448.0f : 57344.0f;
        float amax = 0.0f;
#pragma unroll
        for (int e = 0; e < E; e++) amax = fmaxf(amax, fabsf(x[e]));
        amax = kc_warp_max(amax);
        const uint16_t s16 = amax == 0.0f ? (uint16_t)0x3c00u : fp16_round_up(amax / fmax);
        const float s = kc_h2f(s16);
#pragma unroll
        for (int e = 0; e < E; e++) codes[lane * E + e] = kc_f_to_fp8(x[e] / s, g.kind);
        if (lane == 0) put16(pa, s16);
        break;
    }
    case KVARN_KIND_INT8:
    case KVARN_KIND_INT4: {
        const int bits = g.kind == KVARN_KIND_INT8 ? 8 : 4;
        const float qmax = (float)((1 << bits) - 1);
        float lo = x[0], hi = x[0];
#pragma unroll
        for (int e = 1; e < E; e++) {
            lo = fminf(lo, x[e]);
            hi = fmaxf(hi, x[e]);
        }
        lo = kc_warp_min(lo);
        hi = kc_warp_max(hi);
        const uint16_t z16 = fp16_round_down(lo);
        const float z = kc_h2f(z16);
        const float range = hi - z;
        const uint16_t s16 = range > 0.0f ? fp16_round_up(range / qmax) : (uint16_t)0x3c00u;
        const float s = kc_h2f(s16);
        uint32_t c[E];
#pragma unroll
        for (int e = 0; e < E; e++) {
            float q = (x[e] - z) / s;
            q = fminf(fmaxf(q, 0.0f), qmax);
            c[e] = (uint32_t)rintf(q);
        }
        if (bits == 8) {
#pragma unroll
            for (int e = 0; e < E; e++) codes[lane * E + e] = (uint8_t)c[e];
        } else {
#pragma unroll
            for (int e = 0; e < E; e += 2)
                codes[(lane * E + e) / 2] = (uint8_t)((c[e] & 0xfu) | ((c[e + 1] & 0xfu) << 4));
        }
        if (lane == 0) {
            put16(pa, s16);
            put16(pb, z16);
        }
        break;
    }
    default:
        break;
    }
}

} // namespace

cudaError_t kc_launch_store(const kc_geom &g, int dtype, const void *k, const void *v,
                            const int64_t *slots, int num_tokens, cudaStream_t s)
{
    dim3 grid((unsigned)num_tokens, (unsigned)g.Hk);
#define KC_STORE_CASE(D) \
    case D: {                                                                           \
        auto kernel = store_kernel<D>;                                                  \
        KC_LAUNCH(kernel, grid, 64, 0, s, g, dtype, k, v, slots);                       \
        return cudaGetLastError();                                                      \
    }
    switch (g.D) {
        KVARN_CUDA_HEAD_DIMS(KC_STORE_CASE)
    default:
        return cudaErrorInvalidValue;
    }
#undef KC_STORE_CASE
}
