/*
 * fp8_row_avx512.c -- the fp8 formats' record (fp8_row.h) compiled with
 * AVX-512 (the build's flags for _avx512.c files): the same C, so the same
 * bytes, its max, division and rounding loops 16 lanes wide. Called only
 * where kvarn__cpu_level() is KVARN_CPU_AVX512 (kvarn__fp8_record_encode's
 * avx512 flag: the caller asks the level once per batch).
 */
#include "codec/codec_internal.h"
#include "codec/fp8_row.h"

kvarn_status kvarn__fp8_record_encode_avx512(int e4m3, const kvarn_record_layout *L, const float *k,
                                             const float *v, void *record)
{
    return fp8_record(e4m3, L, k, v, record);
}

int kvarn__fp8_rows_fit_avx512(int e4m3, const float *k, const float *v, int D)
{
    return fp8_rows_fit(e4m3, k, v, D);
}
