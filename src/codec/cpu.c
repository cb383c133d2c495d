/*
 * cpu.c -- CPU feature detection and the KVARN_SIMD cap (see cpu.h).
 */
#include "codec/cpu.h"

#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

static kvarn_cpu_level hardware_level(void)
{
#if defined(__x86_64__) || defined(__i386__)
    /* FMA and F16C from CPUID leaf 1 ECX (bits 12 and 29): clang 14's
     * __builtin_cpu_supports does not know "f16c". AVX2 and AVX-512 go
     * through the builtin, which also checks that the OS saves the wide
     * registers. */
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return KVARN_CPU_SCALAR;
    int fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    int avx2 = __builtin_cpu_supports("avx2") && fma && f16c;
    if (!avx2) return KVARN_CPU_SCALAR;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        return KVARN_CPU_AVX512;
    return KVARN_CPU_AVX2;
#else
    return KVARN_CPU_SCALAR;
#endif
}

/* CPUID is slow where it matters most: under a hypervisor every CPUID
 * traps to it (microseconds), and the Hadamard dispatch asks the level once
 * per row. The CPU's features do not change while a process runs, so the
 * level is found once and kept: -1 = not yet known. Threads that race here
 * all compute and store the same value (relaxed atomics: no torn reads, no
 * data race for TSan). This is the library's only process-wide state and it
 * holds a fact about the hardware, not about any caller. */
static int hw_level_cache = -1;

static kvarn_cpu_level hardware_level_cached(void)
{
    int v = __atomic_load_n(&hw_level_cache, __ATOMIC_RELAXED);
    if (v < 0) {
        v = (int)hardware_level();
        __atomic_store_n(&hw_level_cache, v, __ATOMIC_RELAXED);
    }
    return (kvarn_cpu_level)v;
}

kvarn_cpu_level kvarn__cpu_level(void)
{
    kvarn_cpu_level hw = hardware_level_cached();
    const char *cap = getenv("KVARN_SIMD");
    if (cap == NULL || cap[0] == '\0') return hw;
    kvarn_cpu_level want = hw;
    if (strcmp(cap, "scalar") == 0) want = KVARN_CPU_SCALAR;
    else if (strcmp(cap, "avx2") == 0) want = KVARN_CPU_AVX2;
    else if (strcmp(cap, "avx512") == 0) want = KVARN_CPU_AVX512;
    return want < hw ? want : hw;
}

const char *kvarn__cpu_level_name(kvarn_cpu_level level)
{
    switch (level) {
    case KVARN_CPU_AVX512: return "avx512";
    case KVARN_CPU_AVX2: return "avx2";
    default: return "scalar";
    }
}
