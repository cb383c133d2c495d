/*
 * fp_convert.c -- scalar number conversions between fp32 and the storage
 * types of the cache formats: IEEE fp16, bfloat16, OCP FP8 E4M3 and E5M2.
 *
 * Every narrowing conversion rounds to nearest, ties to even (IEEE 754
 * default), and handles subnormals of the target type exactly.
 *   fp16, bf16  overflow goes to +-Inf (IEEE); NaN stays NaN (made quiet).
 *   FP8 E4M3    OCP: bias 7, max 448 (S.1111.110), no Inf, NaN = S.1111.111;
 *               smallest subnormal 2^-9.
 *   FP8 E5M2    OCP: bias 15, max 57344 (S.11110.11), Inf = S.11111.00,
 *               NaN = S.11111.{01,10,11}; smallest subnormal 2^-16.
 *   Both FP8 types saturate: any finite value beyond the largest finite one
 *   and +-Inf become +-max (the "satfinite" convention); NaN gives NaN.
 * Decoding is exact for every code.
 *
 * The arithmetic is in src/codec/fp_convert.h as branch-free inline
 * functions (the library's loops use those); these are their out-of-line,
 * public forms.
 */
#include "kvarn/kvarn.h"
#include "codec/fp_convert.h"

uint16_t kvarn_fp32_to_fp16(float x) { return kvarn__fp16_from_f32(x); }
float kvarn_fp16_to_fp32(uint16_t h) { return kvarn__fp16_to_f32(h); }
uint16_t kvarn_fp32_to_bf16(float x) { return kvarn__bf16_from_f32(x); }
float kvarn_bf16_to_fp32(uint16_t h) { return kvarn__bf16_to_f32(h); }
uint8_t kvarn_fp32_to_fp8_e4m3(float x) { return kvarn__e4m3_from_f32(x); }
float kvarn_fp8_e4m3_to_fp32(uint8_t b) { return kvarn__e4m3_to_f32(b); }
uint8_t kvarn_fp32_to_fp8_e5m2(float x) { return kvarn__e5m2_from_f32(x); }
float kvarn_fp8_e5m2_to_fp32(uint8_t b) { return kvarn__e5m2_to_f32(b); }
