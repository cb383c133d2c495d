/*
 * per_token.c -- the per-token cache formats (G = 1): fp16, bf16, FP8
 * E4M3/E5M2 with a dynamic fp16 scale, and int8/int4 asymmetric RTN with an
 * fp16 scale and zero-point. One record = the K and V of one token of one KV
 * head; the byte layout is in include/kvarn/record.h, the formulas in
 * docs/formats.md.
 *
 * kvarn_encode (codec.c) has already checked the arguments, the head_dim,
 * the record size and that k and v are finite. What remains to check here is
 * that the stored fp16/bf16 fields stay finite; if any would not, nothing is
 * written and KVARN_ERR_NONFINITE is returned (every field of K and V is
 * computed before the first byte is stored).
 *
 * Quantization of one row x[0..D) (the K or the V of one token-head):
 *   fp8:  amax = max |x|; scale = amax / fp8_max rounded UP to fp16 (so no
 *         element saturates); an all-zero row stores scale 1.0 (codes 0).
 *         code = fp8_rne(x / scale); x' = fp8(code) * scale.
 *   int:  zero = the row minimum rounded DOWN to fp16 (zero <= every x);
 *         scale = (max - zero) / (2^bits - 1) rounded UP to fp16 (so
 *         (x - zero) / scale <= 2^bits - 1); a constant row whose value is
 *         exactly an fp16 stores scale 1.0 (codes 0).
 *         code = clamp(round_half_even((x - zero) / scale), 0, 2^bits - 1);
 *         x' = code * scale + zero, so |x - x'| <= scale / 2.
 *   The codes are computed against the fp16-rounded scale and zero, which
 *   are exactly what decode reads back.
 */
#include <stdint.h>
#include <string.h>

#include "codec/codec_internal.h"
#include "codec/fp8_row.h"
#include "codec/fp_convert.h"
#include "codec/pack.h"
#include "codec/rtn_row.h"
#include "common/cpu.h"

/* Largest head_dim a per-token format serves (kvarn_format_check_head_dim);
 * the row scratch buffers below live on the stack at this size. */
#define KVARN_PER_TOKEN_MAX_D 1024

static inline void store_u16(unsigned char *p, uint16_t v) { memcpy(p, &v, 2); }

static inline uint16_t load_u16(const unsigned char *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* ------------------------------------------------------------ fp16/bf16 */

/* Convert a row to 16-bit values; returns the largest |value| bit pattern
 * (h & 0x7fff), so the caller can see an overflow to Inf. */
static uint16_t convert_row_16(int bf, const float *restrict x, int D, uint16_t *restrict out)
{
    uint16_t mx = 0;
    if (bf) {
        for (int i = 0; i < D; i++) {
            uint16_t h = kvarn__bf16_from_f32(x[i]);
            out[i] = h;
            uint16_t m = (uint16_t)(h & 0x7fffu);
            mx = m > mx ? m : mx;
        }
    } else {
        for (int i = 0; i < D; i++) {
            uint16_t h = kvarn__fp16_from_f32(x[i]);
            out[i] = h;
            uint16_t m = (uint16_t)(h & 0x7fffu);
            mx = m > mx ? m : mx;
        }
    }
    return mx;
}

static kvarn_status encode_16(int bf, const kvarn_record_layout *L,
                              const float *k, const float *v, unsigned char *rec)
{
    const int D = L->head_dim;
    const uint16_t inf = bf ? 0x7f80u : 0x7c00u;
    uint16_t tk[KVARN_PER_TOKEN_MAX_D], tv[KVARN_PER_TOKEN_MAX_D];
    /* convert both rows first: nothing is written unless all fit */
    if (convert_row_16(bf, k, D, tk) >= inf || convert_row_16(bf, v, D, tv) >= inf)
        return KVARN_ERR_NONFINITE;
    memcpy(rec + L->k_codes_off, tk, 2 * (size_t)D);
    memcpy(rec + L->v_codes_off, tv, 2 * (size_t)D);
    return KVARN_OK;
}

static void decode_16(int bf, int D, const unsigned char *src, float *restrict out)
{
    if (out == NULL) return;
    uint16_t h[KVARN_PER_TOKEN_MAX_D];
    memcpy(h, src, 2 * (size_t)D); /* the record may be unaligned */
    if (bf)
        for (int i = 0; i < D; i++) out[i] = kvarn__bf16_to_f32(h[i]);
    else
        for (int i = 0; i < D; i++) out[i] = kvarn__fp16_to_f32(h[i]);
}

/* ------------------------------------------------------------------ fp8 */

static void fp8_row_decode(int e4m3, const unsigned char *restrict codes, int D,
                           uint16_t s16, float *restrict out)
{
    if (out == NULL) return;
    const float s = kvarn__fp16_to_f32(s16);
    if (e4m3)
        for (int i = 0; i < D; i++) out[i] = kvarn__e4m3_to_f32(codes[i]) * s;
    else
        for (int i = 0; i < D; i++) out[i] = kvarn__e5m2_to_f32(codes[i]) * s;
}

/* --------------------------------------------------------- int8 / int4 */

static void rtn_row_decode(const unsigned char *restrict codes, int D, rtn_params p,
                           float *restrict out)
{
    const float s = kvarn__fp16_to_f32(p.scale), z = kvarn__fp16_to_f32(p.zero);
    for (int i = 0; i < D; i++) out[i] = (float)codes[i] * s + z;
}

/* ------------------------------------------ one record: K row and V row */

/* The head_dim range every per-token entry point re-checks (the row's
 * head_dim check in format_kinds.c admits the same range), so that the
 * stack rows above can never overflow whatever the caller passed. */
static int bad_d(int D) { return D < 2 || D > KVARN_PER_TOKEN_MAX_D || D % 2; }

static kvarn_status record_encode_16(int bf, const kvarn_record_layout *L, const float *k,
                                     const float *v, void *record)
{
    if (bad_d(L->head_dim)) return KVARN_ERR_UNSUPPORTED_HEAD_DIM;
    return encode_16(bf, L, k, v, record);
}

static kvarn_status record_decode_16(int bf, const kvarn_record_layout *L, const void *record,
                                     float *k_out, float *v_out)
{
    const unsigned char *rec = record;
    const int D = L->head_dim;
    if (bad_d(D)) return KVARN_ERR_UNSUPPORTED_HEAD_DIM;
    decode_16(bf, D, rec + L->k_codes_off, k_out);
    decode_16(bf, D, rec + L->v_codes_off, v_out);
    return KVARN_OK;
}

static kvarn_status record_encode_fp8(int e4m3, const kvarn_record_layout *L, const float *k,
                                      const float *v, void *record)
{
    if (bad_d(L->head_dim)) return KVARN_ERR_UNSUPPORTED_HEAD_DIM;
    return fp8_record(e4m3, L, k, v, record);
}

kvarn_status kvarn__fp8_record_encode(int e4m3, const kvarn_record_layout *L, const float *k,
                                      const float *v, void *record, int avx512)
{
    if (bad_d(L->head_dim)) return KVARN_ERR_UNSUPPORTED_HEAD_DIM;
    if (avx512) return kvarn__fp8_record_encode_avx512(e4m3, L, k, v, record);
    return fp8_record(e4m3, L, k, v, record);
}

int kvarn__fp8_rows_fit(int e4m3, const float *k, const float *v, int D, int avx512)
{
    if (bad_d(D)) return 0;
    return avx512 ? kvarn__fp8_rows_fit_avx512(e4m3, k, v, D) : fp8_rows_fit(e4m3, k, v, D);
}

static kvarn_status record_decode_fp8(int e4m3, const kvarn_record_layout *L, const void *record,
                                      float *k_out, float *v_out)
{
    const unsigned char *rec = record;
    const int D = L->head_dim;
    if (bad_d(D)) return KVARN_ERR_UNSUPPORTED_HEAD_DIM;
    fp8_row_decode(e4m3, rec + L->k_codes_off, D, load_u16(rec + L->k_a_off), k_out);
    fp8_row_decode(e4m3, rec + L->v_codes_off, D, load_u16(rec + L->v_a_off), v_out);
    return KVARN_OK;
}

/* One RTN row (kvarn__rtn_row_encode or its AVX-512 twin: the same bytes). */
typedef kvarn_status (*rtn_row_fn)(const float *x, int D, int bits, uint8_t *codes,
                                   uint16_t *scale, uint16_t *zero);

static kvarn_status record_encode_rtn_with(int bits, const kvarn_record_layout *L, const float *k,
                                           const float *v, void *record, rtn_row_fn row)
{
    unsigned char *rec = record;
    const int D = L->head_dim;
    if (bad_d(D)) return KVARN_ERR_UNSUPPORTED_HEAD_DIM;
    /* both rows' codes before the first byte is stored */
    unsigned char codes[2][KVARN_PER_TOKEN_MAX_D];
    uint16_t scale[2], zero[2];
    if (row(k, D, bits, codes[0], &scale[0], &zero[0]) != KVARN_OK ||
        row(v, D, bits, codes[1], &scale[1], &zero[1]) != KVARN_OK)
        return KVARN_ERR_NONFINITE;
    const size_t codes_off[2] = {L->k_codes_off, L->v_codes_off};
    const size_t a_off[2] = {L->k_a_off, L->v_a_off};
    const size_t b_off[2] = {L->k_b_off, L->v_b_off};
    for (int r = 0; r < 2; r++) {
        if (bits == 8) memcpy(rec + codes_off[r], codes[r], (size_t)D);
        else (void)kvarn_pack_codes(codes[r], (size_t)D, 4, rec + codes_off[r]);
        store_u16(rec + a_off[r], scale[r]);
        store_u16(rec + b_off[r], zero[r]);
    }
    return KVARN_OK;
}

static kvarn_status record_encode_rtn(int bits, const kvarn_record_layout *L, const float *k,
                                      const float *v, void *record)
{
    return record_encode_rtn_with(bits, L, k, v, record, kvarn__rtn_row_encode);
}

kvarn_status kvarn__rtn_record_encode(int bits, const kvarn_record_layout *L, const float *k,
                                      const float *v, void *record, int avx512)
{
    if (bits != 4 && bits != 8) return KVARN_ERR_INVALID_ARG;
    if (avx512) return record_encode_rtn_with(bits, L, k, v, record, kvarn__rtn_row_encode_avx512);
    return record_encode_rtn_with(bits, L, k, v, record, kvarn__rtn_row_encode);
}

static kvarn_status record_decode_rtn(int bits, const kvarn_record_layout *L, const void *record,
                                      float *k_out, float *v_out)
{
    const unsigned char *rec = record;
    const int D = L->head_dim;
    if (bad_d(D)) return KVARN_ERR_UNSUPPORTED_HEAD_DIM;
    float *outs[2] = {k_out, v_out};
    const size_t codes_off[2] = {L->k_codes_off, L->v_codes_off};
    const size_t a_off[2] = {L->k_a_off, L->v_a_off};
    const size_t b_off[2] = {L->k_b_off, L->v_b_off};
    for (int r = 0; r < 2; r++) {
        if (outs[r] == NULL) continue;
        rtn_params p = {load_u16(rec + a_off[r]), load_u16(rec + b_off[r])};
        if (bits == 8) {
            rtn_row_decode(rec + codes_off[r], D, p, outs[r]);
        } else {
            unsigned char tmp[KVARN_PER_TOKEN_MAX_D];
            (void)kvarn_unpack_codes(rec + codes_off[r], (size_t)D, 4, tmp);
            rtn_row_decode(tmp, D, p, outs[r]);
        }
    }
    return KVARN_OK;
}

/* -------------------------------------- the entry points of each kind's row
 * (format_kinds.c); the workspace, options and flags of the row's signature
 * mean nothing to a per-token record. */

#define KVARN_TOKEN_CODEC(NAME, HELPER, PARAM)                                             \
    kvarn_status kvarn__##NAME##_encode(const kvarn_record_layout *L, const float *k,      \
                                        const float *v, void *record, void *workspace,     \
                                        const kvarn_codec_opts *opts)                      \
    {                                                                                      \
        return record_encode_##HELPER(PARAM, L, k, v, record);                             \
    }                                                                                      \
    kvarn_status kvarn__##NAME##_decode(const kvarn_record_layout *L, const void *record,  \
                                        float *k_out, float *v_out, unsigned flags)        \
    {                                                                                      \
        return record_decode_##HELPER(PARAM, L, record, k_out, v_out);                     \
    }

KVARN_TOKEN_CODEC(fp16, 16, 0)
KVARN_TOKEN_CODEC(bf16, 16, 1)
KVARN_TOKEN_CODEC(fp8_e4m3, fp8, 1)
KVARN_TOKEN_CODEC(fp8_e5m2, fp8, 0)
KVARN_TOKEN_CODEC(int8, rtn, 8)
KVARN_TOKEN_CODEC(int4, rtn, 4)

/* ------------------------------------------ one RTN row for other records
 * (the int8 rope part of an MLA record, src/codec/mla_record.c) */

void kvarn__token_writer_init(kvarn_token_writer *w, const kvarn_format *fmt, int D)
{
    w->fmt = *fmt;
    w->D = D;
    w->bits = fmt->kind == KVARN_KIND_INT8 ? 8 : fmt->kind == KVARN_KIND_INT4 ? 4 : 0;
    w->fp8 = fmt->kind == KVARN_KIND_FP8_E4M3 ? 1 : fmt->kind == KVARN_KIND_FP8_E5M2 ? 2 : 0;
    if ((w->bits || w->fp8) && kvarn_record_layout_get(fmt, D, &w->L) != KVARN_OK) w->bits = w->fp8 = 0;
    w->avx512 = (w->bits || w->fp8) && kvarn__cpu_level() == KVARN_CPU_AVX512;
}

kvarn_status kvarn__token_writer_encode(const kvarn_token_writer *w, const float *k, const float *v,
                                        void *rec, size_t rb)
{
    if (w->bits && rb >= w->L.record_bytes)
        return kvarn__rtn_record_encode(w->bits, &w->L, k, v, rec, w->avx512);
    if (w->fp8 && rb >= w->L.record_bytes)
        return kvarn__fp8_record_encode(w->fp8 == 1, &w->L, k, v, rec, w->avx512);
    return kvarn_encode(&w->fmt, w->D, k, v, rec, rb, NULL, 0, NULL);
}

int kvarn__rtn_rows_fit(const float *k, const float *v, int D, int bits, int avx512)
{
    if (bad_d(D) || (bits != 4 && bits != 8)) return 0;
    return avx512 ? kvarn__rtn_rows_fit_avx512(k, v, D, bits) : rtn_rows_fit(k, v, D, bits);
}

kvarn_status kvarn__rtn_row_encode(const float *x, int D, int bits, uint8_t *codes,
                                   uint16_t *scale, uint16_t *zero)
{
    if (bad_d(D) || (bits != 4 && bits != 8)) return KVARN_ERR_UNSUPPORTED_HEAD_DIM;
    return rtn_row(x, D, bits, codes, scale, zero);
}

void kvarn__rtn_row_decode(const uint8_t *codes, int D, uint16_t scale, uint16_t zero, float *out)
{
    rtn_params p = {scale, zero};
    rtn_row_decode(codes, D, p, out);
}
