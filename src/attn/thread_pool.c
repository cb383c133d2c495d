/*
 * thread_pool.c -- a small fixed pool of pthreads for the attention calls.
 *
 * The caller creates the pool once; each call hands it a task function and a
 * task count. Workers take task indices from a shared atomic counter, so
 * WHICH thread runs a task varies from run to run, but every task writes
 * only its own outputs, which keeps results independent of scheduling. The
 * calling thread works too (worker 0), so a pool of n runs n - 1 pthreads.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "attn/attn_internal.h"
#include "common/alloc_internal.h"

struct kvarn_thread_pool {
    kvarn_allocator alloc;    /* the pool and its thread table (alloc.h) */
    int n_threads;
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t start_cv;  /* workers wait here for a new generation */
    pthread_cond_t done_cv;   /* the caller waits here for the workers */
    unsigned long generation; /* bumped for every run */
    int stop;
    int busy;                 /* workers still inside the current run */
    attn_task_fn fn;
    void *ctx;
    int n_tasks;
    atomic_int next_task;
};

typedef struct worker_arg {
    kvarn_thread_pool *pool;
    int id;
} worker_arg;

static void run_tasks(kvarn_thread_pool *p, int worker)
{
    for (;;) {
        int t = atomic_fetch_add_explicit(&p->next_task, 1, memory_order_relaxed);
        if (t >= p->n_tasks) break;
        p->fn(p->ctx, t, worker);
    }
}

static void *worker_main(void *argp)
{
    worker_arg *a = argp;
    kvarn_thread_pool *p = a->pool;
    int id = a->id;
    unsigned long seen = 0;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        while (!p->stop && p->generation == seen) pthread_cond_wait(&p->start_cv, &p->mu);
        if (p->stop) {
            pthread_mutex_unlock(&p->mu);
            return NULL;
        }
        seen = p->generation;
        pthread_mutex_unlock(&p->mu);

        run_tasks(p, id);

        pthread_mutex_lock(&p->mu);
        if (--p->busy == 0) pthread_cond_signal(&p->done_cv);
        pthread_mutex_unlock(&p->mu);
    }
}

size_t kvarn__thread_pool_bytes(int n_threads)
{
    if (n_threads < 1 || n_threads > 256) return 0;
    /* the two allocations of kvarn_thread_pool_create_ex below */
    return sizeof(kvarn_thread_pool) + (size_t)n_threads * (sizeof(pthread_t) + sizeof(worker_arg));
}

kvarn_status kvarn_thread_pool_create(int n_threads, kvarn_thread_pool **out)
{
    return kvarn_thread_pool_create_ex(n_threads, NULL, out);
}

kvarn_status kvarn_thread_pool_create_ex(int n_threads, const kvarn_allocator *allocator,
                                         kvarn_thread_pool **out)
{
    if (out == NULL || n_threads < 1 || n_threads > 256) return KVARN_ERR_INVALID_ARG;
    kvarn_allocator alloc;
    if (kvarn__alloc_init(&alloc, allocator) != KVARN_OK) return KVARN_ERR_INVALID_ARG;
    kvarn_thread_pool *p = kvarn__calloc(&alloc, 1, sizeof *p);
    if (p == NULL) return KVARN_ERR_NOMEM;
    p->alloc = alloc;
    /* One allocation for the thread ids and the worker arguments. */
    size_t n = (size_t)n_threads;
    p->threads = kvarn__calloc(&alloc, n, sizeof(pthread_t) + sizeof(worker_arg));
    if (p->threads == NULL) {
        kvarn__free(&alloc, p);
        return KVARN_ERR_NOMEM;
    }
    worker_arg *args = (worker_arg *)(p->threads + n);
    p->n_threads = n_threads;
    atomic_init(&p->next_task, 0);
    if (pthread_mutex_init(&p->mu, NULL) != 0) goto fail_mu;
    if (pthread_cond_init(&p->start_cv, NULL) != 0) goto fail_start;
    if (pthread_cond_init(&p->done_cv, NULL) != 0) goto fail_done;
    int started = 0;
    for (int i = 1; i < n_threads; i++) {
        args[i].pool = p;
        args[i].id = i;
        if (pthread_create(&p->threads[i], NULL, worker_main, &args[i]) != 0) break;
        started++;
    }
    if (started != n_threads - 1) {
        p->n_threads = started + 1; /* join only those that run */
        kvarn_thread_pool_destroy(p);
        return KVARN_ERR_NOMEM;
    }
    *out = p;
    return KVARN_OK;

fail_done:
    pthread_cond_destroy(&p->start_cv);
fail_start:
    pthread_mutex_destroy(&p->mu);
fail_mu:
    kvarn__free(&alloc, p->threads);
    kvarn__free(&alloc, p);
    return KVARN_ERR_NOMEM;
}

void kvarn_thread_pool_destroy(kvarn_thread_pool *p)
{
    if (p == NULL) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->start_cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n_threads; i++) pthread_join(p->threads[i], NULL);
    pthread_cond_destroy(&p->done_cv);
    pthread_cond_destroy(&p->start_cv);
    pthread_mutex_destroy(&p->mu);
    const kvarn_allocator a = p->alloc;
    kvarn__free(&a, p->threads);
    kvarn__free(&a, p);
}

int kvarn_thread_pool_size(const kvarn_thread_pool *p)
{
    return p ? p->n_threads : 1;
}

void attn_pool_run(kvarn_thread_pool *p, attn_task_fn fn, void *ctx, int n_tasks)
{
    if (n_tasks <= 0) return;
    if (p == NULL || p->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store_explicit(&p->next_task, 0, memory_order_relaxed);
    p->busy = p->n_threads - 1;
    p->generation++;
    pthread_cond_broadcast(&p->start_cv);
    pthread_mutex_unlock(&p->mu);

    run_tasks(p, 0);

    pthread_mutex_lock(&p->mu);
    while (p->busy > 0) pthread_cond_wait(&p->done_cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
