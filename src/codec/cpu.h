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

/* 1 when kvarn__cpu_level() is KVARN_CPU_AVX512, the CPU has AMX-TILE
 * and AMX-BF16, Linux granted this process the tile state (asked once,
 * on the first call: arch_prctl ARCH_REQ_XCOMP_PERM) and the environment
 * variable KVARN_AMX is not "0": the attention's matrix kernel of KVarN
 * records (src/attn/kernel_amx.c) then runs for items of 16 or more query
 * rows. A refusal (an older kernel, a seccomp filter) leaves 0 and the
 * AVX-512 kernels. Thread-safe. */
int kvarn__cpu_amx_bf16(void);

/* 1 when KVARN_AMX is "emulate": the matrix kernels run with their tile
 * operations emulated in C (slow), on any CPU and at any level, so that
 * their rounding can be measured where no AMX is (docs/attention-matrix.md);
 * kvarn__cpu_amx_bf16() is then 0. For tests and measurements. */
int kvarn__cpu_amx_emulate(void);

/* The name of a level: "scalar", "avx2", "avx512". */
const char *kvarn__cpu_level_name(kvarn_cpu_level level);

#endif
