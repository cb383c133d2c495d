/*
 * cpu.h -- the one place the library asks which SIMD level to run.
 *
 * Every SIMD dispatch (codec, Hadamard, attention kernels) asks
 * kvarn__cpu_level() instead of calling __builtin_cpu_supports itself, so
 * that one environment variable can cap every kernel family at once:
 *
 *   KVARN_SIMD=scalar   only the scalar reference code
 *   KVARN_SIMD=avx2     at most AVX2 (+FMA, F16C)
 *   KVARN_SIMD=avx512   at most AVX-512 (F, BW, VL, plus AVX2/FMA/F16C)
 *   unset or empty      the best level the CPU has
 *
 * The variable can only lower the level, never raise it above what the CPU
 * reports, so a wrong setting cannot run an illegal instruction. An
 * unrecognised value is treated as unset here; kvarn_simd_level (kvarn.h)
 * reports it, and the kvarn command and the benchmarks refuse it. This lets the tests prove that
 * every kernel family agrees with its scalar reference on any machine (as
 * OpenBLAS's OPENBLAS_CORETYPE or oneDNN's ONEDNN_MAX_CPU_ISA do for theirs).
 * Not part of the public contract.
 */
#ifndef KVARN_CPU_H
#define KVARN_CPU_H

typedef enum kvarn_cpu_level {
    KVARN_CPU_SCALAR = 0,
    KVARN_CPU_AVX2 = 1,   /* AVX2 + FMA + F16C */
    KVARN_CPU_AVX512 = 2, /* AVX-512 F/BW/VL, and everything AVX2 has */
} kvarn_cpu_level;

/* The SIMD level to run: the CPU's level (from the feature bits libgcc
 * read at start-up; no CPUID here, see cpu.c), capped by KVARN_SIMD (read
 * on every call, so a test can change it between calls; getenv scans the
 * environment, so callers that dispatch per row or per token should hoist
 * the call out of the loop). Thread-safe: no state is kept. */
kvarn_cpu_level kvarn__cpu_level(void);

/* 1 when kvarn__cpu_level() is KVARN_CPU_AVX512 (so KVARN_SIMD=avx2 or
 * =scalar turn it off too) and the CPU has AVX512-VNNI (vpdpwssd): the
 * attention's KVarN kernel then runs its VNNI build. A feature of the
 * AVX-512 level, not a level of its own. */
int kvarn__cpu_avx512_vnni(void);

/* 1 when kvarn__cpu_level() is KVARN_CPU_AVX512 and the CPU has
 * AVX512-BF16 (vdpbf16ps): the attention's fp8 and bf16 per-token spans of
 * many rows then run kernel_avx512_bf16.c. A feature of the AVX-512 level,
 * as VNNI. */
int kvarn__cpu_avx512_bf16(void);

/* Which AMX tiles the attention's matrix kernels (src/attn/kernel_amx.c,
 * mla_amx.c: items of 16 or more query rows) run on:
 *   KVARN_CPU_AMX_EMULATED  KVARN_AMX is "emulate": the tile operations
 *                           emulated in C (slow), on any CPU and at any
 *                           level, so that their rounding can be measured
 *                           where no AMX is (docs/attention-matrix.md); for
 *                           tests and measurements;
 *   KVARN_CPU_AMX_TILES     kvarn__cpu_level() is KVARN_CPU_AVX512, the CPU
 *                           has AMX-TILE and AMX-BF16, Linux granted this
 *                           process the tile state (asked once, on the first
 *                           call: arch_prctl ARCH_REQ_XCOMP_PERM) and
 *                           KVARN_AMX is not "0";
 *   KVARN_CPU_AMX_NONE      otherwise (a refusal, an older kernel, a seccomp
 *                           filter: the AVX-512 kernels).
 * Thread-safe. */
typedef enum kvarn_cpu_amx {
    KVARN_CPU_AMX_NONE = 0,
    KVARN_CPU_AMX_TILES = 1,
    KVARN_CPU_AMX_EMULATED = 2,
} kvarn_cpu_amx;
kvarn_cpu_amx kvarn__cpu_amx(void);

/* The name of a level: "scalar", "avx2", "avx512". */
const char *kvarn__cpu_level_name(kvarn_cpu_level level);

#endif
