/*
 * simd_env.h -- the kvarn command's and the benchmarks' check of the
 * KVARN_SIMD environment variable (the library ignores a value it does not
 * know; a program that measures or reports per level must not run at a
 * level the user did not mean).
 */
#ifndef KVARN_TOOLS_SIMD_ENV_H
#define KVARN_TOOLS_SIMD_ENV_H

/* 0 when KVARN_SIMD is unset, empty or one of scalar|avx2|avx512
 * (kvarn_simd_level); else 2, the usage-error exit code, after one line on
 * stderr: "PROG: KVARN_SIMD='bogus' is not a SIMD level (accepted:
 * scalar|avx2|avx512; unset or empty: the CPU's best)". */
int simd_env_check(const char *prog);

#endif
