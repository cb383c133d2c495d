/*
 * kvarn_tile_avx2.c -- the KVarN statistics and RTN kernels (kvarn_tile_stats.h)
 * compiled with -mavx2 -mfma -mf16c by the build. kvarn_tile.c calls them
 * only when kvarn__cpu_level() >= KVARN_CPU_AVX2 (common/cpu.h). Same C as the baseline copy,
 * hence bit-identical results (ISO C mode keeps FMA contraction off).
 */
#if defined(__x86_64__) || defined(__i386__)
#define KVARN_TILE_STATS_SUFFIX _avx2
#define KVARN_TILE_STATS_EXPORT
#include "codec/kvarn_tile_stats.h"
#else
typedef int kvarn_tile_avx2_unused; /* keep the translation unit non-empty */
#endif
