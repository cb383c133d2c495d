/* test_parts.h -- one cmocka test program run as several ctest entries
 * (header only).
 *
 * A program whose tests take long under the sanitizers (test_attn: 5 of the
 * ThreadSanitizer stage's 7 minutes on 2 cores) splits them into parts and
 * defines KVARN_TEST_PARTS before including this file. CMakeLists.txt reads
 * that #define from the source and adds one ctest entry a part, NAME.1 ..
 * NAME.N, each run with KVARN_TEST_PART=k, so that `ctest -j` runs the parts
 * side by side. Without KVARN_TEST_PART (running the program by hand) every
 * part runs, in order, as one group. KVARN_TEST_FILTER applies within
 * whatever runs. */
#ifndef KVARN_TEST_PARTS_H
#define KVARN_TEST_PARTS_H

#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <cmocka.h>

typedef struct test_part {
    const struct CMUnitTest *tests;
    size_t n;
} test_part;

#define TEST_PART(array) { (array), sizeof(array) / sizeof((array)[0]) }

/* Runs part KVARN_TEST_PART (1..n_parts) of parts[], or all of them when it
 * is unset; returns what cmocka's group run returns (the failed count), or 1
 * with a message for a KVARN_TEST_PART that names no part. */
static inline int test_run_parts(const char *group, const test_part *parts, int n_parts)
{
    const char *e = getenv("KVARN_TEST_PART");
    if (e != NULL && *e != '\0') {
        char *end = NULL;
        long k = strtol(e, &end, 10);
        if (*end != '\0' || k < 1 || k > n_parts) {
            fprintf(stderr, "%s: KVARN_TEST_PART=%s names no part (1..%d)\n", group, e, n_parts);
            return 1;
        }
        return _cmocka_run_group_tests(group, parts[k - 1].tests, parts[k - 1].n, NULL, NULL);
    }
    size_t n = 0;
    for (int i = 0; i < n_parts; i++) n += parts[i].n;
    struct CMUnitTest *all = malloc(sizeof(*all) * (n ? n : 1));
    if (all == NULL) {
        fprintf(stderr, "%s: out of memory\n", group);
        return 1;
    }
    size_t at = 0;
    for (int i = 0; i < n_parts; i++)
        for (size_t j = 0; j < parts[i].n; j++) all[at++] = parts[i].tests[j];
    int rc = _cmocka_run_group_tests(group, all, n, NULL, NULL);
    free(all);
    return rc;
}

#endif
