/* test_cpu.c -- the SIMD level query of src/common/cpu.c (common/cpu.h).
 *
 * Oracles: the CPU's own feature bits read here with CPUID and XGETBV
 * (Intel SDM vol. 2A "CPUID", leaf 1 ECX and leaf 7 EBX; AMD reports the
 * same bits), independent of the compiler builtins the library uses; the
 * KVARN_SIMD rules of cpu.h; and, where the kernel offers CPUID faulting
 * (arch_prctl ARCH_SET_CPUID: Intel CPUs, not AMD or this project's
 * Firecracker VMs), a child process in which CPUID raises SIGSEGV asks the
 * level and rotates a vector. The level is asked once per Hadamard rotation
 * (~720 times per decoded SmolLM2 token), and a CPUID that traps to the
 * hypervisor costs 8.2 us here, so the query must execute none
 * (tests/codec/no_cpuid.sh checks the library's objects for the
 * instruction on every machine). */
#define _GNU_SOURCE /* syscall() */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#if defined(__x86_64__)
#include <asm/prctl.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#endif

#include "common/cpu.h"
#include "kvarn/kvarn.h"
#include "codec/hadamard.h"
#include "common/testutil.h"


#if defined(__x86_64__)
static uint64_t xgetbv0(void)
{
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

/* The level from the raw bits: AVX2 needs AVX2 (leaf 7 EBX bit 5), FMA
 * (leaf 1 ECX bit 12), F16C (bit 29) and the OS saving XMM/YMM (OSXSAVE,
 * bit 27, and XCR0 bits 1-2); AVX-512 also F/BW/VL (leaf 7 EBX bits 16, 30,
 * 31) and the OS saving opmask/ZMM state (XCR0 bits 5-7). */
static kvarn_cpu_level reference_level(void)
{
    unsigned a, b, c1, d, b7 = 0, c7;
    if (!__get_cpuid(1, &a, &b, &c1, &d)) return KVARN_CPU_SCALAR;
    if (!((c1 >> 27) & 1)) return KVARN_CPU_SCALAR;
    uint64_t xcr0 = xgetbv0();
    if ((xcr0 & 0x6) != 0x6) return KVARN_CPU_SCALAR;
    if (__get_cpuid_max(0, NULL) >= 7) __cpuid_count(7, 0, a, b7, c7, d);
    (void)c7;
    int avx2 = ((b7 >> 5) & 1) && ((c1 >> 12) & 1) && ((c1 >> 29) & 1) && ((c1 >> 28) & 1);
    if (!avx2) return KVARN_CPU_SCALAR;
    int avx512 = ((b7 >> 16) & 1) && ((b7 >> 30) & 1) && ((b7 >> 31) & 1) && (xcr0 & 0xe0) == 0xe0;
    return avx512 ? KVARN_CPU_AVX512 : KVARN_CPU_AVX2;
}
#endif

/* KVARN_SIMD set to value (NULL: unset) for one query. */
static kvarn_cpu_level level_with(const char *value)
{
    if (value) setenv("KVARN_SIMD", value, 1);
    else unsetenv("KVARN_SIMD");
    return kvarn__cpu_level();
}

static void test_level_matches_cpuid(void **state)
{
    (void)state;
#if defined(__x86_64__)
    char *saved = getenv("KVARN_SIMD") ? strdup(getenv("KVARN_SIMD")) : NULL;
    assert_int_equal(level_with(NULL), reference_level());
    if (saved) { setenv("KVARN_SIMD", saved, 1); free(saved); }
    else unsetenv("KVARN_SIMD");
#else
    assert_int_equal(kvarn__cpu_level(), KVARN_CPU_SCALAR);
#endif
}

/* cpu.h: the variable only lowers the level; unknown or empty is unset. */
static void test_cap(void **state)
{
    (void)state;
    char *saved = getenv("KVARN_SIMD") ? strdup(getenv("KVARN_SIMD")) : NULL;
    kvarn_cpu_level hw = level_with(NULL);
    assert_int_equal(level_with("scalar"), KVARN_CPU_SCALAR);
    assert_int_equal(level_with("avx2"), hw < KVARN_CPU_AVX2 ? hw : KVARN_CPU_AVX2);
    assert_int_equal(level_with("avx512"), hw);
    assert_int_equal(level_with(""), hw);
    assert_int_equal(level_with("avx1024"), hw);
    if (saved) { setenv("KVARN_SIMD", saved, 1); free(saved); }
    else unsetenv("KVARN_SIMD");
}

/* kvarn_simd_level (kvarn.h): the level kvarn__cpu_level runs at, by name;
 * KVARN_ERR_INVALID_ARG for a value that names no level (then the CPU's
 * level, as the kernels run), KVARN_OK for unset, empty and the three
 * names. NULL name is allowed. */
static void test_simd_level_reports_bad_values(void **state)
{
    (void)state;
    char *saved = getenv("KVARN_SIMD") ? strdup(getenv("KVARN_SIMD")) : NULL;
    kvarn_cpu_level hw = level_with(NULL);
    static const char *good[] = {NULL, "", "scalar", "avx2", "avx512"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        kvarn_cpu_level lv = level_with(good[i]);
        const char *name = NULL;
        assert_int_equal(kvarn_simd_level(&name), KVARN_OK);
        assert_string_equal(name, kvarn__cpu_level_name(lv));
        assert_int_equal(kvarn_simd_level(NULL), KVARN_OK);
    }
    static const char *bad[] = {"bogus", "AVX2", "avx2 ", "sse4", "avx1024"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(level_with(bad[i]), hw);
        const char *name = NULL;
        assert_int_equal(kvarn_simd_level(&name), KVARN_ERR_INVALID_ARG);
        assert_string_equal(name, kvarn__cpu_level_name(hw));
        assert_int_equal(kvarn_simd_level(NULL), KVARN_ERR_INVALID_ARG);
    }
    if (saved) { setenv("KVARN_SIMD", saved, 1); free(saved); }
    else unsetenv("KVARN_SIMD");
}

/* kvarn__cpu_avx512_vnni: the CPUID bit (leaf 7 ECX bit 11, AVX512-VNNI)
 * at the AVX-512 level, 0 whenever KVARN_SIMD caps the level below it. */
static void test_avx512_vnni(void **state)
{
    (void)state;
    char *saved = getenv("KVARN_SIMD") ? strdup(getenv("KVARN_SIMD")) : NULL;
#if defined(__x86_64__)
    unsigned a = 0, b = 0, c7 = 0, d = 0;
    if (__get_cpuid_max(0, NULL) >= 7) __cpuid_count(7, 0, a, b, c7, d);
    const int bit = (int)((c7 >> 11) & 1);
    unsetenv("KVARN_SIMD");
    assert_int_equal(kvarn__cpu_avx512_vnni(), reference_level() == KVARN_CPU_AVX512 ? bit : 0);
#endif
    setenv("KVARN_SIMD", "avx2", 1);
    assert_int_equal(kvarn__cpu_avx512_vnni(), 0);
    setenv("KVARN_SIMD", "scalar", 1);
    assert_int_equal(kvarn__cpu_avx512_vnni(), 0);
    if (saved) { setenv("KVARN_SIMD", saved, 1); free(saved); }
    else unsetenv("KVARN_SIMD");
}

/* In a child with CPUID faulting on, a CPUID would kill it with SIGSEGV:
 * the level query and a dispatched rotation must run without one. */
static void test_no_cpuid_at_run_time(void **state)
{
    (void)state;
#if defined(__x86_64__) && defined(ARCH_SET_CPUID) && !defined(__clang__)
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0) != 0) _exit(TEST_SKIPPED);
        float x[64];
        for (int i = 0; i < 64; i++) x[i] = (float)i;
        int ok = 1;
        for (int i = 0; i < 1000; i++) ok &= kvarn__cpu_level() >= KVARN_CPU_SCALAR && kvarn__cpu_avx512_vnni() >= 0;
        kvarn_hadamard(x, 64);
        _exit(ok ? 0 : 1);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status)); /* a CPUID in the library: SIGSEGV */
    if (WEXITSTATUS(status) == TEST_SKIPPED) {
        /* no CPUID faulting here (this case only; the other cases ran and
         * test_no_cpuid still checks the library's code) */
        skip();
    }
    assert_int_equal(WEXITSTATUS(status), 0);
#else
    skip();
#endif
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_level_matches_cpuid),
        cmocka_unit_test(test_cap),
        cmocka_unit_test(test_simd_level_reports_bad_values),
        cmocka_unit_test(test_avx512_vnni),
        cmocka_unit_test(test_no_cpuid_at_run_time),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    return failed;
}
