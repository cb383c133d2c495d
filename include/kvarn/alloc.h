/*
 * alloc.h -- the caller's allocator, used by every object the library
 * creates.
 *
 * Every create / open / load call takes an optional kvarn_allocator (a field
 * of its opts struct, or the `_ex` variant of the call). The object keeps a
 * copy and makes every allocation and free of its life through it: the
 * object itself, its arenas, tables and scratch, and the memory PCRE2 takes
 * for the tokenizer's patterns. NULL (or both function pointers NULL) means
 * the C library's malloc/free; the calls without an allocator behave exactly
 * as before. Memory the C library's other dependencies keep for themselves
 * (OpenBLAS buffers, thread stacks, a GGUF file's mmap) is not routed.
 *
 * Contract:
 *   - alloc(opaque, bytes) returns bytes (> 0) of memory aligned for any
 *     object type (alignof(max_align_t), as malloc), or NULL when it cannot.
 *     The library never asks for 0 bytes. Memory it wants zeroed or more
 *     aligned (64-byte arenas) it zeroes and aligns itself: with a caller's
 *     allocator a cache's arenas are written at creation, where calloc
 *     would have mapped their zero pages lazily.
 *   - free(opaque, ptr) releases a pointer alloc returned; the library never
 *     passes NULL.
 *   - Both are called from the thread that calls the library function that
 *     allocates (creation calls, tokenizer encode, cache seq create/fork);
 *     never from the attention thread pool's workers. Objects used from
 *     several threads at once need a thread-safe allocator.
 *   - The allocator (its functions and whatever opaque points to) must
 *     outlive every object created with it.
 *   - A failed allocation makes the call return KVARN_ERR_NOMEM, free what it
 *     took, and leave every object it was given as it was (the fault-injection
 *     test, tests/model/test_fault_injection.c, fails each allocation in turn).
 *
 * The idea is zstd's ZSTD_customMem; the design here is this library's own.
 */
#ifndef KVARN_ALLOC_H
#define KVARN_ALLOC_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvarn_allocator {
    void *(*alloc)(void *opaque, size_t bytes); /* NULL: malloc */
    void (*free)(void *opaque, void *ptr);      /* NULL: free; set both or neither */
    void *opaque;                               /* passed back unchanged */
} kvarn_allocator;

#ifdef __cplusplus
}
#endif

#endif
