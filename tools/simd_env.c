/* simd_env.c -- refuse an unknown KVARN_SIMD (see simd_env.h). */
#include "simd_env.h"

#include <stdio.h>
#include <stdlib.h>

#include "kvarn/kvarn.h"

int simd_env_check(const char *prog)
{
    if (kvarn_simd_level(NULL) == KVARN_OK) return 0;
    const char *v = getenv("KVARN_SIMD");
    fprintf(stderr,
            "%s: KVARN_SIMD='%s' is not a SIMD level (accepted: scalar|avx2|avx512; unset or "
            "empty: the CPU's best)\n",
            prog, v ? v : "");
    return 2;
}
