/*
 * kvarn_tile_avx512.c -- the KVarN statistics and RTN kernels
 * (kvarn_tile_stats.h) compiled with AVX-512 (F/BW/VL) by the build.
 * kvarn_tile.c calls them only when kvarn__cpu_level() >= KVARN_CPU_AVX512
 * (codec/cpu.h). Same C as the baseline copy, hence the same bytes (ISO C
 * mode keeps FMA contraction off; the loops fix every sum's order).
 */
#if defined(__x86_64__) || defined(__i386__)
#define KVARN_TILE_STATS_SUFFIX _avx512
#define KVARN_TILE_STATS_EXPORT
#include "codec/kvarn_tile_stats.h"
#else
typedef int kvarn_tile_avx512_unused; /* keep the translation unit non-empty */
#endif
