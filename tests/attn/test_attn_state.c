/* test_attn_state.c -- attention over a restored sequence (include/kvarn/
 * state.h) is bit for bit attention over the sequence that was saved: for
 * every case of tests/cache/state_fixture.h, decode and multi-query
 * attention (kvarn_attn_decode, kvarn_attn_multi) on every layer of the
 * saved sequence and of its copy restored into a fresh cache, before and
 * after both grow by the same tokens. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "cache/state_fixture.h"
#include "kvarn/attn.h"

enum { HQ = 6, NQ = 3 };

/* Decode and 3-query attention of layer l of seq in c, into out
 * [(1 + NQ) * HQ * D] floats. */
static void attend(kvarn_cache *c, int seq, int l, const float *q, float *out)
{
    kvarn_paged_kv kv;
    kvarn_seq_view sv;
    assert_int_equal(kvarn_cache_layer_view(c, l, &kv), KVARN_OK);
    assert_int_equal(kvarn_cache_seq_view(c, seq, &sv), KVARN_OK);
    kvarn_attn_opts o = KVARN_ATTN_OPTS_DEFAULT(0.125f);
    size_t wsz = kvarn_attn_workspace_bytes(&kv, HQ, 1, NQ, 1, &o);
    void *ws = malloc(wsz);
    assert_int_equal(kvarn_attn_decode(&kv, &sv, 1, HQ, q, out, &o, NULL, ws, wsz), KVARN_OK);
    const int32_t qsl[2] = {0, NQ};
    assert_int_equal(kvarn_attn_multi(&kv, &sv, 1, qsl, HQ, q, out + HQ * ST_D, &o, NULL, ws, wsz),
                     KVARN_OK);
    free(ws);
}

static void same_attention(kvarn_cache *a, int sa, kvarn_cache *b, int sb, const char *name)
{
    const size_t n = (size_t)(1 + NQ) * HQ * ST_D;
    float q[NQ * HQ * ST_D], *oa = malloc(n * sizeof(float)), *ob = malloc(n * sizeof(float));
    test_rng r;
    test_rng_seed(&r, 0xa77e);
    for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) q[i] = (float)test_rng_normal(&r);
    for (int l = 0; l < ST_L; l++) {
        attend(a, sa, l, q, oa);
        attend(b, sb, l, q, ob);
        if (memcmp(oa, ob, n * sizeof(float)) != 0)
            fail_msg("case '%s', layer %d: attention over the restored sequence differs", name, l);
    }
    free(oa);
    free(ob);
}

static void test_attention_restored(void **state)
{
    (void)state;
    for (int i = 0; i < ST_N_CASES; i++) {
        const st_case *k = &st_cases[i];
        int seq = -1, r = -1;
        kvarn_cache *c = st_build(k, &seq);
        assert_non_null(c);
        size_t n = 0;
        uint8_t *b = st_save(c, seq, &n);
        assert_non_null(b);
        kvarn_cache_opts o = st_opts(k);
        kvarn_cache *fresh = NULL;
        assert_int_equal(kvarn_cache_create(&o, &fresh), KVARN_OK);
        assert_int_equal(kvarn_cache_seq_restore(fresh, b, n, &r), KVARN_OK);
        same_attention(c, seq, fresh, r, k->name);
        kvarn_cache_seq_info si;
        assert_int_equal(kvarn_cache_seq_get_info(c, seq, &si), KVARN_OK);
        assert_int_equal(st_append(c, seq, 140, si.seq_len + 140, 0), KVARN_OK);
        assert_int_equal(st_append(fresh, r, 140, si.seq_len + 140, 0), KVARN_OK);
        same_attention(c, seq, fresh, r, k->name);
        free(b);
        kvarn_cache_destroy(fresh);
        kvarn_cache_destroy(c);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attention_restored),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
