/* fuzz_gguf.c -- fuzz target of the GGUF reader (include/kvarn/gguf.h).
 *
 * fuzz_gguf_one() opens any bytes with kvarn_gguf_open_memory and, when they
 * are accepted, reads back everything a model loader would: every key as
 * every type, every array element, every tensor dequantized in full. It must
 * never crash, read out of bounds or leak, whatever the input.
 *
 * Built two ways:
 *   - with libFuzzer: clang -fsanitize=fuzzer,address -DKVARN_LIBFUZZER -Isrc
 *       -Iinclude tests/fuzz/fuzz_gguf.c src/gguf/gguf.c src/gguf/dequant.c
 *       src/codec/fp_convert.c
 *   - included by tests/fuzz/test_fuzz_gguf.c, a cmocka driver that feeds it
 *     mutations of a valid synthetic file (run by ctest, ASan in CI). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvarn/gguf.h"

/* Returns the open status; when KVARN_OK, *checksum mixes what was read so
 * that nothing is optimized away. */
static kvarn_status fuzz_gguf_one(const uint8_t *data, size_t size, double *checksum)
{
    char err[160];
    kvarn_gguf *g = NULL;
    double sum = 0.0;
    kvarn_status st = kvarn_gguf_open_memory(data, size, &g, err, sizeof err);
    if (st != KVARN_OK) {
        /* A rejected file always says why. */
        if (err[0] == '\0' || g != NULL) abort();
        return st;
    }
    for (uint64_t i = 0; i < kvarn_gguf_kv_count(g); i++) {
        char key[256];
        if (kvarn_gguf_str_copy(kvarn_gguf_kv_key(g, i), key, sizeof key) != KVARN_OK) continue;
        if (kvarn_gguf_find_key(g, key) != (int64_t)i) abort();
        uint32_t u32;
        int32_t i32;
        uint64_t u64;
        int64_t i64;
        float f;
        int b;
        kvarn_gguf_str s;
        kvarn_gguf_array a;
        if (kvarn_gguf_get_u32(g, key, &u32) == KVARN_OK) sum += u32;
        if (kvarn_gguf_get_i32(g, key, &i32) == KVARN_OK) sum += i32;
        if (kvarn_gguf_get_u64(g, key, &u64) == KVARN_OK) sum += (double)u64;
        if (kvarn_gguf_get_i64(g, key, &i64) == KVARN_OK) sum += (double)i64;
        if (kvarn_gguf_get_f32(g, key, &f) == KVARN_OK && f == f) sum += f;
        if (kvarn_gguf_get_bool(g, key, &b) == KVARN_OK) sum += b;
        if (kvarn_gguf_get_string(g, key, &s) == KVARN_OK && s.len) sum += (unsigned char)s.ptr[s.len - 1];
        if (kvarn_gguf_get_array(g, key, &a) == KVARN_OK) {
            for (uint64_t j = 0; j < a.n; j++) {
                if (kvarn_gguf_array_string(g, key, j, &s) == KVARN_OK && s.len)
                    sum += (unsigned char)s.ptr[0] + (unsigned char)s.ptr[s.len - 1];
                if (kvarn_gguf_array_i64(g, key, j, &i64) == KVARN_OK) sum += (double)i64;
                if (kvarn_gguf_array_f32(g, key, j, &f) == KVARN_OK && f == f) sum += f;
            }
            if (kvarn_gguf_array_i64(g, key, a.n, &i64) != KVARN_ERR_INVALID_ARG) abort();
        }
    }
    for (uint64_t i = 0; i < kvarn_gguf_tensor_count(g); i++) {
        const kvarn_gguf_tensor *t = kvarn_gguf_tensor_at(g, i);
        if (kvarn_gguf_find_tensor(g, t->name) != t) abort();
        /* Dequantize row by row into a small buffer (a row can be large
         * only if the file is: its bytes are inside the input). */
        uint64_t row = t->ne[0], nrows = t->n_elements / row;
        if (row > (1u << 20)) continue;
        float *buf = malloc((size_t)row * sizeof(float));
        if (!buf) continue;
        for (uint64_t r = 0; r < nrows; r++) {
            if (kvarn_gguf_tensor_dequantize(t, r * row, row, buf) != KVARN_OK) abort();
            for (uint64_t j = 0; j < row; j++)
                if (buf[j] == buf[j]) sum += buf[j] * 1e-30;
        }
        free(buf);
    }
    kvarn_gguf_close(g);
    if (checksum) *checksum += sum;
    return KVARN_OK;
}

#ifdef KVARN_LIBFUZZER
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    double sum = 0.0;
    fuzz_gguf_one(data, size, &sum);
    return 0;
}
#endif
