/*
 * alloc_internal.h -- the one place the library allocates (src/common/alloc.c).
 * Every src/ file allocates and frees through these, with the allocator its
 * object keeps (include/kvarn/alloc.h). Not part of the public contract.
 */
#ifndef KVARN_ALLOC_INTERNAL_H
#define KVARN_ALLOC_INTERNAL_H

#include <stddef.h>

#include "kvarn/alloc.h"
#include "kvarn/kvarn.h"

/* Normalize a caller's allocator into *out (by value, so objects keep a
 * copy): NULL or both functions NULL -> the C library's (all fields NULL).
 * Errors: KVARN_ERR_INVALID_ARG when exactly one function is set. */
kvarn_status kvarn__alloc_init(kvarn_allocator *out, const kvarn_allocator *a);

/* n * size bytes, uninitialized (malloc); NULL on failure, on overflow of
 * n * size, and for 0 bytes (callers that may need 0 ask for 1). */
void *kvarn__malloc(const kvarn_allocator *a, size_t n, size_t size);

/* The same, zeroed. With the C library's allocator this is calloc, so a
 * large zeroed arena is mapped lazily and not touched here. */
void *kvarn__calloc(const kvarn_allocator *a, size_t n, size_t size);

/* Grow (or shrink) p from old_bytes to new_bytes (> 0), keeping the first
 * min(old, new) bytes; p may be NULL (old_bytes 0). On failure NULL is
 * returned and p is left as it was (still owned by the caller). With a
 * caller's allocator: alloc + copy + free. */
void *kvarn__realloc(const kvarn_allocator *a, void *p, size_t old_bytes,
                     size_t new_bytes);

/* Release p (NULL is a no-op). */
void kvarn__free(const kvarn_allocator *a, void *p);

/* bytes (> 0) aligned to align (a power of two, <= 4096), zeroed when zero
 * is 1. Over-allocates by align and keeps the pointer to free just below the
 * aligned one: release with kvarn__free_aligned only. NULL on failure. */
void *kvarn__malloc_aligned(const kvarn_allocator *a, size_t bytes,
                            size_t align, int zero);
void kvarn__free_aligned(const kvarn_allocator *a, void *p);

#endif
