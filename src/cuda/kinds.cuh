/*
 * kinds.cuh -- the device half of a format kind's row (the codec half is
 * src/codec/format_kinds.h, the CPU kernels' src/attn/kernel_table.c): for
 * each per-token kind, how the store kernel encodes one row of a token
 * record and how the attention kernels read 8 channels of it back. The
 * kernels are templates over the kind, so each traits struct below is
 * compiled into the kernels of its kind only; kc_token_encode is the one
 * run-time dispatch on the kind (the store kernel's), generated from the
 * list in dispatch.h.
 *
 * Adding a per-token kind here = one kc_kind specialization and one entry
 * of KVARN_CUDA_TOKEN_KINDS. Bit for bit as src/codec/per_token.c encodes
 * (fp16 scale rounded up, zero-point rounded down, codes against the
 * rounded values); record layout include/kvarn/record.h.
 * Internal to src/cuda.
 */
#ifndef KVARN_CUDA_KINDS_CUH
#define KVARN_CUDA_KINDS_CUH

#include "cuda/common.cuh"

/* Smallest fp16 >= x for finite x >= 0 (per_token.c fp16_round_up). */
__device__ __forceinline__ uint16_t kc_fp16_round_up(float x)
{
    uint16_t h = kc_f2h(x);
    if ((h & 0x7c00u) != 0x7c00u && kc_h2f(h) < x) h++;
    return h;
}

/* Largest fp16 <= x for finite x (per_token.c fp16_round_down). */
__device__ __forceinline__ uint16_t kc_fp16_round_down(float x)
{
    uint16_t h = kc_f2h(x);
    if ((h & 0x7c00u) != 0x7c00u && kc_h2f(h) > x) {
        if (h & 0x8000u) h++;
        else h--;
    }
    if (h == 0x8000u) h = 0;
    return h;
}

__device__ __forceinline__ void kc_put16(uint8_t *p, uint16_t v)
{
    *reinterpret_cast<uint16_t *>(p) = v;
}

/* One per-token kind on the device. Every specialization has
 *   encode<E>(x, codes, pa, pb, lane): one row (K or V) of one token-head,
 *     spread over a warp, lane holding channels [lane*E, lane*E + E):
 *     codes, and the fp16 scale at pa / zero-point at pb where the kind
 *     has them (record.h);
 *   load8(rec, codes_off, a_off, b_off, c8, w): channels [c8*8, c8*8 + 8)
 *     of that row, dequantized. */
template <int KIND>
struct kc_kind;

/* fp16 and bf16: the values themselves. */
template <bool BF>
struct kc_kind_16 {
    template <int E>
    __device__ static void encode(const float (&x)[E], uint8_t *codes, uint8_t *, uint8_t *,
                                  int lane)
    {
#pragma unroll
        for (int e = 0; e < E; e++)
            kc_put16(codes + 2 * (lane * E + e), BF ? kc_f2bf(x[e]) : kc_f2h(x[e]));
    }
    __device__ static void load8(const uint8_t *rec, int codes_off, int, int, int c8,
                                 float (&w)[8])
    {
        const uint8_t *p = rec + codes_off + c8 * 16;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const uint32_t u = kc_ld32(p + 4 * e);
            w[2 * e] = BF ? kc_bf2f((uint16_t)(u & 0xffffu)) : kc_h2f((uint16_t)(u & 0xffffu));
            w[2 * e + 1] = BF ? kc_bf2f((uint16_t)(u >> 16)) : kc_h2f((uint16_t)(u >> 16));
        }
    }
};

/* FP8 (E4M3: max 448, E5M2: max 57344) with an fp16 scale per row. */
template <int FMT, int MAX>
struct kc_kind_fp8 {
    template <int E>
    __device__ static void encode(const float (&x)[E], uint8_t *codes, uint8_t *pa, uint8_t *,
                                  int lane)
    {
        float amax = 0.0f;
#pragma unroll
        for (int e = 0; e < E; e++) amax = fmaxf(amax, fabsf(x[e]));
        amax = kc_warp_max(amax);
        const uint16_t s16 =
            amax == 0.0f ? (uint16_t)0x3c00u : kc_fp16_round_up(amax / (float)MAX);
        const float s = kc_h2f(s16);
#pragma unroll
        for (int e = 0; e < E; e++)
            codes[lane * E + e] = (uint8_t)__nv_cvt_float_to_fp8(
                x[e] / s, __NV_SATFINITE, (__nv_fp8_interpretation_t)FMT);
        if (lane == 0) kc_put16(pa, s16);
    }
    __device__ static float to_f(uint8_t b)
    {
        __half_raw r = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b,
                                               (__nv_fp8_interpretation_t)FMT);
        return __half2float(__half(r));
    }
    __device__ static void load8(const uint8_t *rec, int codes_off, int a_off, int, int c8,
                                 float (&w)[8])
    {
        const uint8_t *p = rec + codes_off + c8 * 8; /* 2-byte aligned only */
        const float s = kc_h2f(kc_ld16(rec + a_off));
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const uint32_t u = kc_ld16(p + 2 * e);
            w[2 * e] = to_f((uint8_t)(u & 0xffu)) * s;
            w[2 * e + 1] = to_f((uint8_t)(u >> 8)) * s;
        }
    }
};

/* int8 / int4: asymmetric RTN with an fp16 scale and zero-point per row. */
template <int BITS>
struct kc_kind_int {
    template <int E>
    __device__ static void encode(const float (&x)[E], uint8_t *codes, uint8_t *pa, uint8_t *pb,
                                  int lane)
    {
        const float qmax = (float)((1 << BITS) - 1);
        float lo = x[0], hi = x[0];
#pragma unroll
        for (int e = 1; e < E; e++) {
            lo = fminf(lo, x[e]);
            hi = fmaxf(hi, x[e]);
        }
        lo = kc_warp_min(lo);
        hi = kc_warp_max(hi);
        const uint16_t z16 = kc_fp16_round_down(lo);
        const float z = kc_h2f(z16);
        const float range = hi - z;
        const uint16_t s16 = range > 0.0f ? kc_fp16_round_up(range / qmax) : (uint16_t)0x3c00u;
        const float s = kc_h2f(s16);
        uint32_t c[E];
#pragma unroll
        for (int e = 0; e < E; e++) {
            float q = (x[e] - z) / s;
            q = fminf(fmaxf(q, 0.0f), qmax);
            c[e] = (uint32_t)rintf(q);
        }
        if (BITS == 8) {
#pragma unroll
            for (int e = 0; e < E; e++) codes[lane * E + e] = (uint8_t)c[e];
        } else {
#pragma unroll
            for (int e = 0; e < E; e += 2)
                codes[(lane * E + e) / 2] = (uint8_t)((c[e] & 0xfu) | ((c[e + 1] & 0xfu) << 4));
        }
        if (lane == 0) {
            kc_put16(pa, s16);
            kc_put16(pb, z16);
        }
    }
    __device__ static void load8(const uint8_t *rec, int codes_off, int a_off, int b_off, int c8,
                                 float (&w)[8])
    {
        const float s = kc_h2f(kc_ld16(rec + a_off)), z = kc_h2f(kc_ld16(rec + b_off));
        float c[8];
        kc_load_codes8<BITS>(rec + codes_off + c8 * BITS, c);
#pragma unroll
        for (int e = 0; e < 8; e++) w[e] = c[e] * s + z;
    }
};

template <> struct kc_kind<KVARN_KIND_FP16> : kc_kind_16<false> {};
template <> struct kc_kind<KVARN_KIND_BF16> : kc_kind_16<true> {};
template <> struct kc_kind<KVARN_KIND_FP8_E4M3> : kc_kind_fp8<__NV_E4M3, 448> {};
template <> struct kc_kind<KVARN_KIND_FP8_E5M2> : kc_kind_fp8<__NV_E5M2, 57344> {};
template <> struct kc_kind<KVARN_KIND_INT8> : kc_kind_int<8> {};
template <> struct kc_kind<KVARN_KIND_INT4> : kc_kind_int<4> {};

/* Encode one row of a token record for a kind known at run time (the store
 * kernel serves every per-token kind): the one switch on the kind, over the
 * list of dispatch.h. Kinds not in the list write nothing (the host
 * refuses them first, kvarn_cuda_supports). */
template <int E>
__device__ __forceinline__ void kc_token_encode(int kind, const float (&x)[E], uint8_t *codes,
                                                uint8_t *pa, uint8_t *pb, int lane)
{
    switch (kind) {
#define KC_ENCODE_CASE(D_, KIND_)                                                   \
    case KIND_: kc_kind<KIND_>::template encode<E>(x, codes, pa, pb, lane); break;
        KVARN_CUDA_TOKEN_KINDS(KC_ENCODE_CASE, 0)
#undef KC_ENCODE_CASE
    default: break;
    }
}

#endif
