/* format_list.c -- the cache-format list parser (see format_list.h). */
#include "format_list.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Longest item looked at: every accepted name is far shorter, and a longer
 * one is reported (cut) as unknown. */
#define ITEM_MAX 64

/* Write "<message>; accepted: <names> (or all)" into err; returns -1. */
__attribute__((format(printf, 3, 4)))
static int fail(char *err, size_t err_len, const char *fmt, ...)
{
    if (err == NULL || err_len == 0) return -1;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
    if (n >= 0 && (size_t)n < err_len)
        snprintf(err + n, err_len - (size_t)n, "; accepted: %s (or all)", kvarn_format_accepted_names());
    return -1;
}

/* Check every item of list (pass 0) or fill out (pass 1). Returns the count
 * or -1 with err written. */
static int parse_items(const char *list, kvarn_format *out, int max, int fill, char *err,
                       size_t err_len)
{
    int n = 0;
    const char *p = list;
    for (;;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        n++;
        if (len == 0)
            return fail(err, err_len, "empty item %d in the cache-format list '%s': separate names "
                        "with single commas", n, list);
        if (n > max)
            return fail(err, err_len, "too many cache formats in '%s' (at most %d)", list, max);
        char item[ITEM_MAX + 1];
        size_t keep = len < ITEM_MAX ? len : ITEM_MAX;
        memcpy(item, p, keep);
        item[keep] = '\0';
        if (strcmp(item, "all") == 0)
            return fail(err, err_len, "'all' must stand alone, not be item %d of the list '%s'",
                        n, list);
        kvarn_format f;
        kvarn_status st = len > ITEM_MAX ? KVARN_ERR_UNKNOWN_FORMAT : kvarn_format_parse(item, &f);
        if (st != KVARN_OK) {
            if (err && err_len) kvarn_format_explain(st, item, 0, err, err_len);
            return -1;
        }
        if (fill) out[n - 1] = f;
        if (comma == NULL) return n;
        p = comma + 1;
    }
}

int format_list_parse(const char *list, kvarn_format *out, int max, char *err, size_t err_len)
{
    if (err && err_len) err[0] = '\0';
    if (list == NULL || out == NULL || max < 1)
        return fail(err, err_len, "no cache-format list given");
    if (list[0] == '\0') return fail(err, err_len, "empty cache-format list");
    if (strcmp(list, "all") == 0) {
        int n = kvarn_format_count();
        if (n > max)
            return fail(err, err_len, "'all' is %d cache formats, more than the %d allowed here", n, max);
        for (int i = 0; i < n; i++)
            if (kvarn_format_parse(kvarn_format_name_at(i), &out[i]) != KVARN_OK)
                return fail(err, err_len, "format table row %d ('%s') does not parse", i,
                            kvarn_format_name_at(i));
        return n;
    }
    /* Check everything first: a bad list leaves out untouched. */
    if (parse_items(list, out, max, 0, err, err_len) < 0) return -1;
    return parse_items(list, out, max, 1, err, err_len);
}
