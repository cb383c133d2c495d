/*
 * mla_avx512.c -- the folded MLA tile kernels (mla_kernels.h) compiled with
 * AVX-512 F/BW/VL (CMakeLists.txt kvarn_simd_flags), 16 fp32 lanes.
 */
#include "attn/mla_kernels.h"
#if defined(__x86_64__) || defined(__i386__)
#define ATTN_MLA_SFX _avx512
#define ATTN_MLA_LANES 16
#include "attn/mla_kernels.h"
#endif
