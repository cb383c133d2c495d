/*
 * eval_stats.h -- per-format accumulators of `kvarn eval`: KL divergence
 * per position (for mean, median, p99, max), top-1 agreement, negative
 * log-likelihood of the text (perplexity).
 */
#ifndef KVARN_TOOLS_EVAL_STATS_H
#define KVARN_TOOLS_EVAL_STATS_H

#include <stddef.h>

typedef struct eval_stats {
    double *kld;      /* one per scored position */
    size_t n, cap;
    size_t top1;      /* positions whose argmax equals the reference's */
    double nll;       /* sum of -log p(next token) */
} eval_stats;

typedef struct eval_summary {
    double kld_mean, kld_median, kld_p99, kld_max, top1;
    size_t n;
} eval_summary;

/* Room for cap positions. 0 on success, -1 out of memory. */
int eval_stats_init(eval_stats *s, size_t cap);
void eval_stats_free(eval_stats *s);
/* One position: its KLD, whether top-1 agrees, and -log p(next token).
 * Positions beyond cap are ignored. */
void eval_stats_add(eval_stats *s, double kld, int top1_agrees, double nll);
/* Mean, median, 99th percentile (nearest rank) and max of the KLDs; top-1
 * share. Sorts s->kld in place. */
void eval_stats_summarize(eval_stats *s, eval_summary *out);
/* exp(mean NLL); 0 when empty. */
double eval_stats_ppl(const eval_stats *s);

#endif
