/*
 * store.cu -- the store kernel: K/V of freshly computed tokens into the
 * paged cache, addressed by the slot mapping (include/kvarn/attn.h).
 *   KVarN: rotate each token-head by H/sqrt(D) and write fp16 into the
 *          staging page row (../shared/spec/KVARN.md "The fp16 tail").
 *   per-token formats: encode the token record in place, bit for bit as
 *          src/codec/per_token.c does, through the kind's device traits
 *          (src/cuda/kinds.cuh).
 * One thread block per (token, KV head); warp 0 handles K, warp 1 V; lane l
 * holds channels [l*E, l*E + E), E = D / 32.
 */
#include "cuda/common.cuh"
#include "cuda/kinds.cuh"

namespace {

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

    kc_token_encode<E>(g.kind, x, codes, pa, pb, lane);
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
