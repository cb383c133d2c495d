/*
 * format_list.h -- the one parser of cache-format lists ("int8,kvarn_k4v2_g128",
 * "all") used by every kvarn subcommand (--kv-cache-dtype) and every
 * benchmark (--formats / --format / --kv-cache-dtype), so that they all
 * accept and reject the same lists with the same messages.
 */
#ifndef KVARN_TOOLS_FORMAT_LIST_H
#define KVARN_TOOLS_FORMAT_LIST_H

#include <stddef.h>

#include "kvarn/kvarn.h"

/* Parse list into out[0..max-1] and return the count (>= 1), or -1 with a
 * one-line message in err (err_len bytes, NUL-terminated; err may be NULL).
 *
 * list: "all" alone is every row of the format table, in ladder order (the
 * count is then kvarn_format_count(), an error if that exceeds max);
 * otherwise names separated by single commas, each one that
 * kvarn_format_parse accepts (table rows, aliases, any
 * kvarn_k{2,4,8}v{2,4,8}_g{32,64,128}), kept in the given order, repeats
 * kept. Rejected, with the accepted names listed: an empty list, an empty
 * item ("fp16,,int8", ",int8", "int8,"), an unknown name (the library's own
 * kvarn_format_explain message), "all" inside a longer list, more than max
 * items. On error out is left as it was. Allocates nothing. */
int format_list_parse(const char *list, kvarn_format *out, int max, char *err, size_t err_len);

#endif
