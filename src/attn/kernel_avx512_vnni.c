/*
 * kernel_avx512_vnni.c -- the AVX-512 KVarN record kernel built with
 * AVX512-VNNI (compiled with -mavx512vnni, CMakeLists.txt): the same source
 * as kernel_avx512.c, whose int16 dot products (vpmaddwd + vpaddd) become
 * one vpdpwssd each (dot_i16): the int32 sums are exact either way, so the
 * scores are the same bits. Its 2-bit V of 128-token tiles runs vpdpbusd
 * against weights rounded to u8 (kv_vsum2_u8; docs/attention-intdot.md
 * "u8 weights"), so those sums differ from the vpmaddwd build's within the
 * bound there. attn.c runs attn_avx512vnni_kvarn_tile in place
 * of attn_avx512_kvarn_tile when kvarn__cpu_avx512_vnni() (codec/cpu.h)
 * says the CPU has VNNI and the call's testing knobs do not turn it off.
 * The tile kernel alone took 19% less time than the vpmaddwd build on
 * AMD Zen 4 (docs/attention-intdot.md "Integer (int16) dot products").
 */
#define KVARN_AVX512_VNNI 1
#include "attn/kernel_avx512.c"
