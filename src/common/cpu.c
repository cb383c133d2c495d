/*
 * cpu.c -- CPU feature detection and the KVARN_SIMD cap (see cpu.h).
 */
#define _GNU_SOURCE /* syscall (unistd.h) */
#include "common/cpu.h"
#include "kvarn/kvarn.h"

#include <stdlib.h>
#include <string.h>
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if (defined(__x86_64__) || defined(__i386__)) && defined(__clang__)
#include <cpuid.h>
#endif

/* Whether the CPU has FMA and F16C (the AVX2 kernels use both).
 *
 * GCC: __builtin_cpu_supports reads the feature bits libgcc's start-up code
 * stored once (__cpu_model), so this executes no CPUID. CPUID is not cheap
 * everywhere: in this project's Firecracker VMs each one traps to the
 * hypervisor, 8.2 us measured, and the level is asked once per Hadamard
 * rotation (a KVarN decode step of SmolLM2 asked ~720 times per token, 5.9
 * ms: the fixed cost that made kvarn_k4v2_g128 at depth 0 run 0.7x the fp16
 * cache). tests/codec/test_cpu.c checks that the library holds no CPUID.
 *
 * clang 14 does not know "f16c" as a feature string, so clang builds (the
 * fuzz targets) read CPUID leaf 1 ECX (FMA bit 12, F16C bit 29) directly. */
#if defined(__x86_64__) || defined(__i386__)
static int has_fma_f16c(void)
{
#if defined(__clang__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    return ((c >> 12) & 1) && ((c >> 29) & 1);
#else
    return __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
}
#endif

static kvarn_cpu_level hardware_level(void)
{
#if defined(__x86_64__) || defined(__i386__)
    /* AVX2 and AVX-512 through the builtin, which also checks that the OS
     * saves the wide registers. */
    int avx2 = __builtin_cpu_supports("avx2") && has_fma_f16c();
    if (!avx2) return KVARN_CPU_SCALAR;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        return KVARN_CPU_AVX512;
    return KVARN_CPU_AVX2;
#else
    return KVARN_CPU_SCALAR;
#endif
}

/* The level KVARN_SIMD caps hw at; *ok = 0 when it names no level (the
 * cap is then ignored). */
static kvarn_cpu_level capped_level(kvarn_cpu_level hw, int *ok)
{
    *ok = 1;
    const char *cap = getenv("KVARN_SIMD");
    if (cap == NULL || cap[0] == '\0') return hw;
    kvarn_cpu_level want = hw;
    if (strcmp(cap, "scalar") == 0) want = KVARN_CPU_SCALAR;
    else if (strcmp(cap, "avx2") == 0) want = KVARN_CPU_AVX2;
    else if (strcmp(cap, "avx512") == 0) want = KVARN_CPU_AVX512;
    else *ok = 0;
    return want < hw ? want : hw;
}

kvarn_cpu_level kvarn__cpu_level(void)
{
    int ok;
    return capped_level(hardware_level(), &ok);
}

kvarn_status kvarn_simd_level(const char **name)
{
    int ok;
    kvarn_cpu_level level = capped_level(hardware_level(), &ok);
    if (name) *name = kvarn__cpu_level_name(level);
    return ok ? KVARN_OK : KVARN_ERR_INVALID_ARG;
}

int kvarn__cpu_avx512_vnni(void)
{
#if defined(__x86_64__) || defined(__i386__)
    return kvarn__cpu_level() == KVARN_CPU_AVX512 && __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

int kvarn__cpu_avx512_bf16(void)
{
#if defined(__x86_64__) || defined(__i386__)
    return kvarn__cpu_level() == KVARN_CPU_AVX512 && __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

/* Linux hands out the AMX tile data state per process on request
 * (Documentation/arch/x86/xstate.rst: arch_prctl ARCH_REQ_XCOMP_PERM with
 * XFEATURE_XTILEDATA); asked once, the answer kept. Two threads asking at
 * once both make the same idempotent request. */
#define KVARN_ARCH_REQ_XCOMP_PERM 0x1023
#define KVARN_XFEATURE_XTILEDATA 18
static int amx_granted(void)
{
#if defined(__linux__) && defined(__x86_64__) && !defined(__clang__)
    static int state = 0; /* 0 not asked, 1 granted, 2 refused */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        /* the kernels convert with AVX512-BF16 (every AMX CPU has it) */
        if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
            !__builtin_cpu_supports("avx512bf16"))
            s = 2;
        else s = syscall(SYS_arch_prctl, KVARN_ARCH_REQ_XCOMP_PERM, KVARN_XFEATURE_XTILEDATA) == 0 ? 1 : 2;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s == 1;
#else
    return 0;
#endif
}

kvarn_cpu_amx kvarn__cpu_amx(void)
{
    const char *v = getenv("KVARN_AMX");
    if (v != NULL && strcmp(v, "emulate") == 0) return KVARN_CPU_AMX_EMULATED;
    if (v != NULL && strcmp(v, "0") == 0) return KVARN_CPU_AMX_NONE;
    if (kvarn__cpu_level() != KVARN_CPU_AVX512) return KVARN_CPU_AMX_NONE;
    return amx_granted() ? KVARN_CPU_AMX_TILES : KVARN_CPU_AMX_NONE;
}

const char *kvarn__cpu_level_name(kvarn_cpu_level level)
{
    switch (level) {
    case KVARN_CPU_AVX512: return "avx512";
    case KVARN_CPU_AVX2: return "avx2";
    default: return "scalar";
    }
}
