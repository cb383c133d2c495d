/*
 * alloc.c -- every allocation of the library goes through here, with the
 * caller's allocator or the C library's (include/kvarn/alloc.h). This is the
 * only file that calls malloc / calloc / realloc / free.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/alloc_internal.h"

kvarn_status kvarn__alloc_init(kvarn_allocator *out, const kvarn_allocator *a)
{
    if (out == NULL) return KVARN_ERR_INVALID_ARG;
    memset(out, 0, sizeof *out);
    if (a == NULL || (a->alloc == NULL && a->free == NULL)) return KVARN_OK;
    if (a->alloc == NULL || a->free == NULL) return KVARN_ERR_INVALID_ARG;
    *out = *a;
    return KVARN_OK;
}

static int is_custom(const kvarn_allocator *a)
{
    return a != NULL && a->alloc != NULL;
}

void *kvarn__malloc(const kvarn_allocator *a, size_t n, size_t size)
{
    if (n == 0 || size == 0 || n > SIZE_MAX / size) return NULL;
    if (is_custom(a)) return a->alloc(a->opaque, n * size);
    return malloc(n * size);
}

void *kvarn__calloc(const kvarn_allocator *a, size_t n, size_t size)
{
    if (n == 0 || size == 0 || n > SIZE_MAX / size) return NULL;
    if (!is_custom(a)) return calloc(n, size);
    void *p = a->alloc(a->opaque, n * size);
    if (p != NULL) memset(p, 0, n * size);
    return p;
}

void *kvarn__realloc(const kvarn_allocator *a, void *p, size_t old_bytes,
                     size_t new_bytes)
{
    if (new_bytes == 0) return NULL;
    if (!is_custom(a)) return realloc(p, new_bytes);
    void *q = a->alloc(a->opaque, new_bytes);
    if (q == NULL) return NULL;
    if (p != NULL) {
        memcpy(q, p, old_bytes < new_bytes ? old_bytes : new_bytes);
        a->free(a->opaque, p);
    }
    return q;
}

void kvarn__free(const kvarn_allocator *a, void *p)
{
    if (p == NULL) return;
    if (is_custom(a)) a->free(a->opaque, p);
    else free(p);
}

void *kvarn__malloc_aligned(const kvarn_allocator *a, size_t bytes,
                            size_t align, int zero)
{
    if (bytes == 0 || align < sizeof(void *) || align > 4096 ||
        (align & (align - 1)) != 0 || bytes > SIZE_MAX - align - sizeof(void *))
        return NULL;
    const size_t total = bytes + align + sizeof(void *);
    /* calloc for the C library: big zeroed arenas stay lazily mapped. */
    void *raw = zero ? kvarn__calloc(a, 1, total) : kvarn__malloc(a, 1, total);
    if (raw == NULL) return NULL;
    uintptr_t p = ((uintptr_t)raw + sizeof(void *) + align - 1) & ~(uintptr_t)(align - 1);
    memcpy((void *)(p - sizeof(void *)), &raw, sizeof raw);
    return (void *)p;
}

void kvarn__free_aligned(const kvarn_allocator *a, void *p)
{
    if (p == NULL) return;
    void *raw;
    memcpy(&raw, (char *)p - sizeof(void *), sizeof raw);
    kvarn__free(a, raw);
}
