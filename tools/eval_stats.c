/* eval_stats.c -- see eval_stats.h. */
#include "eval_stats.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int eval_stats_init(eval_stats *s, size_t cap)
{
    memset(s, 0, sizeof *s);
    s->kld = malloc(sizeof(double) * (cap ? cap : 1));
    if (s->kld == NULL) return -1;
    s->cap = cap;
    return 0;
}

void eval_stats_free(eval_stats *s)
{
    free(s->kld);
    memset(s, 0, sizeof *s);
}

void eval_stats_add(eval_stats *s, double kld, int top1_agrees, double nll)
{
    if (s->n >= s->cap) return;
    s->kld[s->n++] = kld;
    s->top1 += top1_agrees != 0;
    s->nll += nll;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

void eval_stats_summarize(eval_stats *s, eval_summary *out)
{
    memset(out, 0, sizeof *out);
    out->n = s->n;
    if (s->n == 0) return;
    qsort(s->kld, s->n, sizeof(double), cmp_double);
    double sum = 0.0;
    for (size_t i = 0; i < s->n; i++) sum += s->kld[i];
    out->kld_mean = sum / (double)s->n;
    out->kld_median = s->n % 2 ? s->kld[s->n / 2] : 0.5 * (s->kld[s->n / 2 - 1] + s->kld[s->n / 2]);
    size_t r = (size_t)ceil(0.99 * (double)s->n);
    out->kld_p99 = s->kld[(r ? r : 1) - 1];
    out->kld_max = s->kld[s->n - 1];
    out->top1 = (double)s->top1 / (double)s->n;
}

double eval_stats_ppl(const eval_stats *s)
{
    return s->n ? exp(s->nll / (double)s->n) : 0.0;
}
