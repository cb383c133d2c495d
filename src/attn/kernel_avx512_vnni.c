/*
 * kernel_avx512_vnni.c -- the AVX-512 KVarN record kernel and int8 / int4
 * per-token kernels built with AVX512-VNNI (compiled with -mavx512vnni,
 * CMakeLists.txt): the sources of kernel_avx512_kvarn.c and
 * kernel_avx512_int8.c with KVARN_AVX512_VNNI defined, exporting
 * attn_avx512vnni_kvarn_tile and attn_avx512vnni_token_int8 / _int4. Their int16
 * dot products (vpmaddwd + vpaddd) become one vpdpwssd each (dot_i16,
 * kernel_avx512.h): the int32 sums are exact either way, so the scores are
 * the same bits. Its 2-bit V of 128-token KVarN tiles runs vpdpbusd
 * against weights rounded to u8 (kv_vsum2_u8; docs/attention-intdot.md
 * "u8 weights"), so those sums differ from the vpmaddwd build's within the
 * bound there; its int8 K where D % 64 == 0 runs vpdpbusd on the query's
 * int8 digits (i8v_kdots16), the same bits. attn_dispatch.c picks these in place of
 * attn_avx512_kvarn_tile / attn_avx512_token_int8 / _int4 when
 * kvarn__cpu_avx512_vnni() (common/cpu.h) says the CPU has VNNI and the
 * call's testing knobs do not turn it off. The KVarN tile kernel alone
 * took 19% less time than the vpmaddwd build on AMD Zen 4
 * (docs/attention-intdot.md "Integer (int16) dot products").
 */
#define KVARN_AVX512_VNNI 1
#include "attn/kernel_avx512_kvarn.c"
#include "attn/kernel_avx512_int8.c"
