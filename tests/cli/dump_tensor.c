/* dump_tensor.c -- test helper for tests/cli/test_gguf_dequant.py: opens a
 * GGUF file with libkvarn's reader and writes tensors dequantized to fp32.
 *
 * Usage: dump_tensor MODEL.gguf OUTDIR NAME...
 * For each NAME writes OUTDIR/<index>.f32 (n_elements little-endian fp32,
 * ne[0] fastest) and prints one line "NAME TYPE n_dims ne0 ne1 ne2 ne3" to
 * stdout. Exit status 1 with a message on stderr on any error. Built by the
 * test itself against build/libkvarn.a; not part of the library. */
#include <stdio.h>
#include <stdlib.h>

#include "kvarn/gguf.h"

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: dump_tensor MODEL.gguf OUTDIR NAME...\n");
        return 2;
    }
    char err[256];
    kvarn_gguf *g = NULL;
    kvarn_status st = kvarn_gguf_open(argv[1], &g, err, sizeof err);
    if (st != KVARN_OK) {
        fprintf(stderr, "dump_tensor: %s: %s (%s)\n", argv[1], err, kvarn_strerror(st));
        return 1;
    }
    int rc = 0;
    for (int i = 3; i < argc && rc == 0; i++) {
        const kvarn_gguf_tensor *t = kvarn_gguf_find_tensor(g, argv[i]);
        if (!t) {
            fprintf(stderr, "dump_tensor: no tensor '%s'\n", argv[i]);
            rc = 1;
            break;
        }
        float *buf = malloc((size_t)t->n_elements * sizeof(float));
        char path[4096];
        snprintf(path, sizeof path, "%s/%d.f32", argv[2], i - 3);
        FILE *f = buf ? fopen(path, "wb") : NULL;
        if (!f || kvarn_gguf_tensor_dequantize(t, 0, t->n_elements, buf) != KVARN_OK ||
            fwrite(buf, sizeof(float), (size_t)t->n_elements, f) != (size_t)t->n_elements) {
            fprintf(stderr, "dump_tensor: cannot dequantize or write '%s'\n", argv[i]);
            rc = 1;
        } else {
            printf("%s %s %u %llu %llu %llu %llu\n", t->name, kvarn_ggml_type_name(t->type),
                   t->n_dims, (unsigned long long)t->ne[0], (unsigned long long)t->ne[1],
                   (unsigned long long)t->ne[2], (unsigned long long)t->ne[3]);
        }
        if (f && fclose(f) != 0) rc = 1;
        free(buf);
    }
    kvarn_gguf_close(g);
    return rc;
}
