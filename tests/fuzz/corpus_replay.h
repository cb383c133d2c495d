/* corpus_replay.h -- replays the committed corpus of a fuzz target,
 * tests/fuzz/corpus/<target>/: the seeds scripts/fuzz.sh starts from and
 * every input a campaign found crashing (named crash-*, kept with its fix).
 * Used by the test_fuzz_* cmocka programs. */
#ifndef KVARN_TEST_CORPUS_REPLAY_H
#define KVARN_TEST_CORPUS_REPLAY_H

#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Called with the bytes of one file (in a buffer of exactly that size, so
 * that ASan sees any read past the end; data is non-NULL even for an empty
 * file) and its name; returns 0 when every invariant held. */
typedef int (*corpus_fn)(const uint8_t *data, size_t size, const char *name);

/* Run fn on every regular file of $KVARN_SOURCE_DIR/tests/fuzz/corpus/target
 * (ctest sets KVARN_SOURCE_DIR). Returns the number of files replayed, -1
 * when the directory cannot be read, -2 on a file that cannot be read; on
 * the first file that fn refuses, its name is written to bad (bad_len bytes)
 * and -3 is returned. */
static int corpus_replay(const char *target, corpus_fn fn, char *bad, size_t bad_len)
{
    const char *root = getenv("KVARN_SOURCE_DIR");
    char dir[4096];
    if (root == NULL || snprintf(dir, sizeof dir, "%s/tests/fuzz/corpus/%s", root, target) >= (int)sizeof dir)
        return -1;
    DIR *d = opendir(dir);
    if (d == NULL) return -1;
    int n = 0, rc = 0;
    for (struct dirent *e = readdir(d); e != NULL && rc == 0; e = readdir(d)) {
        if (e->d_name[0] == '.') continue;
        char path[8192];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        FILE *f = fopen(path, "rb");
        if (f == NULL) { rc = -2; break; }
        size_t size = 0;
        uint8_t *data = NULL;
        if (fseek(f, 0, SEEK_END) == 0) {
            long end = ftell(f);
            if (end >= 0 && fseek(f, 0, SEEK_SET) == 0) {
                size = (size_t)end;
                data = malloc(size ? size : 1);
                if (data && fread(data, 1, size, f) != size) { free(data); data = NULL; }
            }
        }
        fclose(f);
        if (data == NULL) { rc = -2; break; }
        if (fn(data, size, e->d_name) != 0) {
            snprintf(bad, bad_len, "%s", e->d_name);
            rc = -3;
        }
        free(data);
        n++;
    }
    closedir(d);
    return rc ? rc : n;
}

#endif
