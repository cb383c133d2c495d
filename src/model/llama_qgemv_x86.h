/*
 * llama_qgemv_x86.h -- what the AVX2 and AVX-512 gguf-weights GEMVs
 * (llama_qgemv_avx2.c, llama_qgemv_avx512.c) share: the row blocking, the
 * prefetch distance and the fp16 block fields read as floats. Included
 * only by files compiled with F16C (-mf16c, or -mavx512f which implies it).
 */
#ifndef KVARN_MODEL_LLAMA_QGEMV_X86_H
#define KVARN_MODEL_LLAMA_QGEMV_X86_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* Rows per pass: each activation load is shared by this many rows, whose
 * blocks are streamed side by side. */
#define LLAMA_QGEMV_ROWS 4
/* Software prefetch distance, bytes ahead in each row's stream: a decode
 * step reads every matrix from memory once, and the hardware prefetcher
 * alone left the Q8_0 head at 6 GB/s where 4 KiB ahead gave 14 GB/s
 * (one core, Zen 4; the Q4_1 rows are compute-bound either way). A
 * prefetch never faults, so it may run past the matrix. */
#define LLAMA_QGEMV_AHEAD 4096
#define INLINE static inline __attribute__((always_inline))

/* The two fp16 fields at b (a block's d, then m for Q4_1) as floats in
 * lanes 0 and 1 (exact: every fp16 is an fp32). */
INLINE __m128 half2(const uint8_t *b)
{
    uint32_t v;
    memcpy(&v, b, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)v));
}

/* The fp16 field at b (a block's d) as a float in lane 0. */
INLINE __m128 half1(const uint8_t *b)
{
    uint16_t v;
    memcpy(&v, b, 2);
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)v));
}

#endif
