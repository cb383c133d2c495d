/*
 * checked.h -- checked 64-bit size arithmetic for every count of tokens,
 * blocks, pages and bytes the library computes (cache geometry, session
 * buffers, attention workspaces, weight buffers). Internal, header-only.
 *
 * Each helper stores the exact result in *out and returns 0, or returns 1
 * when the result does not fit (then *out holds UINT64_MAX / SIZE_MAX, so a
 * chain of helpers stays saturated and the caller may test once at the
 * end: `bad |= kvarn__mul_u64(a, b, &x); bad |= kvarn__add_u64(x, c, &y);`).
 * A size that does not fit is a request the library cannot hold: callers
 * turn it into KVARN_ERR_TOO_LARGE before allocating anything.
 */
#ifndef KVARN_COMMON_CHECKED_H
#define KVARN_COMMON_CHECKED_H

#include <stddef.h>
#include <stdint.h>

/* a * b */
static inline int kvarn__mul_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    if (a != 0 && b > UINT64_MAX / a) {
        *out = UINT64_MAX;
        return 1;
    }
    *out = a * b;
    return 0;
}

/* a + b */
static inline int kvarn__add_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    if (b > UINT64_MAX - a) {
        *out = UINT64_MAX;
        return 1;
    }
    *out = a + b;
    return 0;
}

/* a * b * c (three factors: layers x heads x bytes, tokens x heads x D, ...) */
static inline int kvarn__mul3_u64(uint64_t a, uint64_t b, uint64_t c, uint64_t *out)
{
    uint64_t ab;
    int bad = kvarn__mul_u64(a, b, &ab);
    return bad | kvarn__mul_u64(ab, c, out);
}

/* ceil(a / b) for b >= 1, without forming a + b - 1 (which can wrap). */
static inline uint64_t kvarn__ceil_div_u64(uint64_t a, uint64_t b)
{
    return a / b + (a % b != 0);
}

/* A uint64_t byte or element count as a size_t (what malloc takes). */
static inline int kvarn__u64_to_size(uint64_t v, size_t *out)
{
    if (v > (uint64_t)SIZE_MAX) {
        *out = SIZE_MAX;
        return 1;
    }
    *out = (size_t)v;
    return 0;
}

/* a * b in size_t (element count times element size, ...). */
static inline int kvarn__mul_size(size_t a, size_t b, size_t *out)
{
    uint64_t v;
    int bad = kvarn__mul_u64((uint64_t)a, (uint64_t)b, &v);
    return bad | kvarn__u64_to_size(v, out);
}

/* a + b in size_t. */
static inline int kvarn__add_size(size_t a, size_t b, size_t *out)
{
    uint64_t v;
    int bad = kvarn__add_u64((uint64_t)a, (uint64_t)b, &v);
    return bad | kvarn__u64_to_size(v, out);
}

#endif /* KVARN_COMMON_CHECKED_H */
