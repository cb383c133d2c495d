/*
 * block_pool.c -- reference-counted pools of block ids and page ids. A block
 * (or page) id is shared by every layer, as in vLLM; sequences that share a
 * prefix (kvarn_cache_seq_fork) hold the same ids and the count says how
 * many do. Free ids are kept on a stack: allocation and release are O(1) and
 * never allocate memory.
 */
#include <stdlib.h>

#include "cache/cache_internal.h"

kvarn_status kvarn__pool_init(kvarn_id_pool *p, int n, const kvarn_allocator *a)
{
    p->n = n;
    p->n_free = n;
    p->refs = NULL;
    p->free_ids = NULL;
    if (n == 0) return KVARN_OK;
    p->refs = kvarn__calloc(a, (size_t)n, sizeof *p->refs);
    p->free_ids = kvarn__malloc(a, (size_t)n, sizeof *p->free_ids);
    if (p->refs == NULL || p->free_ids == NULL) {
        kvarn__pool_release(p, a);
        return KVARN_ERR_NOMEM;
    }
    /* Low ids on top of the stack, so a fresh cache hands out 0, 1, 2, ... */
    for (int i = 0; i < n; i++) p->free_ids[i] = n - 1 - i;
    return KVARN_OK;
}

void kvarn__pool_release(kvarn_id_pool *p, const kvarn_allocator *a)
{
    kvarn__free(a, p->refs);
    kvarn__free(a, p->free_ids);
    p->refs = NULL;
    p->free_ids = NULL;
    p->n = p->n_free = 0;
}

int32_t kvarn__pool_alloc(kvarn_id_pool *p)
{
    int32_t id = p->free_ids[--p->n_free];
    p->refs[id] = 1;
    return id;
}

void kvarn__pool_incref(kvarn_id_pool *p, int32_t id)
{
    if (id >= 0) p->refs[id]++;
}

void kvarn__pool_decref(kvarn_id_pool *p, int32_t id)
{
    if (id < 0) return;
    if (--p->refs[id] == 0) p->free_ids[p->n_free++] = id;
}

int kvarn__pool_shared(const kvarn_id_pool *p, int32_t id)
{
    return id >= 0 && p->refs[id] > 1;
}
