/* levels.h -- walk the SIMD levels this process runs, one pass each, with
 * KVARN_SIMD set to the pass's level and put back afterwards (header only).
 *
 *     LEVELS_FOR(it) {
 *         ... run at it.name; it.index 0 is "scalar", the oracle, and
 *         comes first, so a test computes its reference in that pass and
 *         compares in the others ...
 *     }
 *
 * Which levels exist and which this process runs are the library's facts,
 * asked through kvarn_simd_level (kvarn.h), never restated: the walk is
 * every KVARN_SIMD value, lowest first, up to the level the library runs
 * when the walk begins (the CPU's best, capped by an outer KVARN_SIMD as
 * scripts/test.sh's configuration matrix sets it), and each one is checked
 * to be a level the library accepts and runs as named. The names below are
 * the values KVARN_SIMD takes (kvarn.h); a level the library reports that
 * they do not name stops the program (levels_begin), so a new level cannot
 * go unwalked; tests/attn/test_levels.c also checks them against the
 * attention kernel table's level rows.
 *
 * A test that runs at one level rather than walking them holds it:
 * levels_hold(i) sets level i, capped at the level the library runs, and
 * levels_end puts KVARN_SIMD back.
 *
 * The value KVARN_SIMD had before the walk (or its absence) comes back when
 * levels_next runs out. A body that leaves the loop early (break, return,
 * goto) calls levels_end(&it) first; a cmocka failure jumps out of the body
 * without it, so a test program whose level walks can fail names
 * levels_teardown as its tests' teardown (cmocka_unit_test_teardown), which
 * puts back what any unfinished walk had saved. Walks nest (an inner walk
 * runs up to the outer pass's level). Not thread-safe (setenv), as the
 * tests' own level settings were not.
 */
#ifndef KVARN_TEST_LEVELS_H
#define KVARN_TEST_LEVELS_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvarn/kvarn.h"

/* The values KVARN_SIMD takes, lowest level first (kvarn.h
 * kvarn_simd_level). */
#define LEVELS_MAX 3
static const char *const levels_names[LEVELS_MAX] = {"scalar", "avx2", "avx512"};

typedef struct levels_iter {
    const char *name; /* the pass's level, as KVARN_SIMD names it */
    int index;        /* its position in levels_names: 0 scalar, ... */
    int count;        /* levels walked: levels_names[0 .. count-1] */
    int depth;        /* slot of the saved KVARN_SIMD (levels__saved); -1
                         once put back */
} levels_iter;

/* The values KVARN_SIMD had when each unfinished walk began (NULL: unset),
 * innermost last. */
#define LEVELS_DEPTH 8
static char *levels__saved[LEVELS_DEPTH];
static int levels__had[LEVELS_DEPTH];
static int levels__depth = 0;

static inline void levels__put(int had, const char *value)
{
    if (had) setenv("KVARN_SIMD", value, 1);
    else unsetenv("KVARN_SIMD");
}

/* Position of name in levels_names, or -1. */
static inline int levels_index_of(const char *name)
{
    for (int i = 0; i < LEVELS_MAX; i++)
        if (name != NULL && strcmp(name, levels_names[i]) == 0) return i;
    return -1;
}

/* Index of the highest level the library runs now (the CPU's best under
 * the current KVARN_SIMD): levels_names[0 .. levels_top()] is what a walk
 * begun now visits. Stops the program when the library names a level
 * levels_names lacks. */
static inline int levels_top(void)
{
    const char *now = NULL;
    (void)kvarn_simd_level(&now); /* an invalid outer value: the CPU's best */
    const int top = levels_index_of(now);
    if (top < 0) {
        fprintf(stderr, "levels.h: the library runs SIMD level '%s', which levels_names lacks\n",
                now ? now : "(null)");
        abort();
    }
    return top;
}

/* KVARN_SIMD set to level i's name, or, above levels_top() as it was when
 * a case asked for it, to that top: for tests whose cases name a level
 * (test_attn's attn_case.level) rather than walking them. No restore: the
 * caller's walk or its own save does that. */
static inline void levels_set_capped(int i, int top)
{
    setenv("KVARN_SIMD", levels_names[i > top ? top : i < 0 ? 0 : i], 1);
}

/* Put back the KVARN_SIMD that walk it saved; idempotent. */
static inline void levels_end(levels_iter *it)
{
    if (it->depth < 0) return;
    /* walks end innermost first; a longer stack means an inner walk
     * jumped out without ending: put back from there */
    while (levels__depth > it->depth) {
        const int d = --levels__depth;
        levels__put(levels__had[d], levels__saved[d]);
        free(levels__saved[d]);
        levels__saved[d] = NULL;
    }
    it->depth = -1;
}

/* Begin a walk: saves KVARN_SIMD and finds the levels (each below the
 * current top probed: the library must run it under its own name). The
 * first levels_next sets the first level. */
static inline levels_iter levels_begin(void)
{
    levels_iter it = {NULL, -1, 0, -1};
    if (levels__depth >= LEVELS_DEPTH) {
        fprintf(stderr, "levels.h: walks nested deeper than %d\n", LEVELS_DEPTH);
        abort();
    }
    const char *outer = getenv("KVARN_SIMD");
    const int d = levels__depth++;
    levels__had[d] = outer != NULL;
    levels__saved[d] = outer ? strdup(outer) : NULL;
    if (outer && !levels__saved[d]) abort();
    it.depth = d;
    const int top = levels_top();
    for (int i = 0; i <= top; i++) {
        const char *got = NULL;
        setenv("KVARN_SIMD", levels_names[i], 1);
        if (kvarn_simd_level(&got) != KVARN_OK || got == NULL || strcmp(got, levels_names[i]) != 0) {
            fprintf(stderr, "levels.h: KVARN_SIMD=%s runs '%s' (below the top, %s)\n",
                    levels_names[i], got ? got : "(null)", levels_names[top]);
            abort();
        }
    }
    levels__put(levels__had[d], levels__saved[d]);
    it.count = top + 1;
    return it;
}

/* Move to the next level and set KVARN_SIMD to it: 1; past the last, put
 * back the saved value: 0. */
static inline int levels_next(levels_iter *it)
{
    if (it->depth < 0) return 0;
    if (++it->index >= it->count) {
        it->name = NULL;
        levels_end(it);
        return 0;
    }
    it->name = levels_names[it->index];
    setenv("KVARN_SIMD", it->name, 1);
    return 1;
}

/* One pass per level, scalar first; `it` is the levels_iter of the body. */
#define LEVELS_FOR(it) for (levels_iter it = levels_begin(); levels_next(&it);)

/* One level instead of a walk, for a test that must run at a given level
 * (or below it): KVARN_SIMD set to level i capped at the level the library
 * runs now (levels_set_capped), the earlier value saved as a walk saves it;
 * levels_end(&it) puts it back (levels_teardown after a failure). it.name
 * and it.index: the level set. A levels_iter that holds nothing (none
 * begun yet) is LEVELS_NONE; levels_end on it does nothing. */
#define LEVELS_NONE {NULL, -1, 0, -1}
static inline levels_iter levels_hold(int i)
{
    levels_iter it = levels_begin();
    const int top = it.count - 1;
    levels_set_capped(i, top);
    it.index = i > top ? top : i < 0 ? 0 : i;
    it.name = levels_names[it.index];
    it.count = it.index + 1; /* levels_next: no further pass, put back */
    return it;
}

/* A cmocka teardown (int (*)(void **)): puts back what walks left
 * unfinished by a failure's jump. */
static inline int levels_teardown(void **state)
{
    (void)state;
    while (levels__depth > 0) {
        const int d = --levels__depth;
        levels__put(levels__had[d], levels__saved[d]);
        free(levels__saved[d]);
        levels__saved[d] = NULL;
    }
    return 0;
}

#endif
