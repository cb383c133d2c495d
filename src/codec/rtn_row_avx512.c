/*
 * rtn_row_avx512.c -- kvarn__rtn_row_encode (per_token.c) compiled with
 * AVX-512 (the build's flags for _avx512.c files): rtn_row.h's C, so the
 * same bytes, its min/max and division loops 16 lanes wide. Called only
 * where kvarn__cpu_level() is KVARN_CPU_AVX512 (kvarn__rtn_record_encode's
 * avx512 flag: the caller asks the level once per batch).
 */
#include "codec/codec_internal.h"
#include "codec/rtn_row.h"

kvarn_status kvarn__rtn_row_encode_avx512(const float *x, int D, int bits, uint8_t *codes,
                                          uint16_t *scale, uint16_t *zero)
{
    if (D < 1 || (bits != 4 && bits != 8)) return KVARN_ERR_UNSUPPORTED_HEAD_DIM;
    return rtn_row(x, D, bits, codes, scale, zero);
}

int kvarn__rtn_rows_fit_avx512(const float *k, const float *v, int D, int bits)
{
    return D >= 1 && (bits == 4 || bits == 8) && rtn_rows_fit(k, v, D, bits);
}
