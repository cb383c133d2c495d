/*
 * mla_avx2.c -- the folded MLA tile kernels (mla_kernels.h) compiled with
 * AVX2 + FMA (CMakeLists.txt kvarn_simd_flags), 8 fp32 lanes.
 */
#include "attn/mla_kernels.h"
#if defined(__x86_64__) || defined(__i386__)
#define ATTN_MLA_SFX _avx2
#define ATTN_MLA_LANES 8
#include "attn/mla_kernels.h"
#endif
