/* test_levels.c -- one harness for every format x kernel-table row x SIMD
 * level (issue 45; as ggml's test-backend-ops runs every operation on
 * every backend against the CPU reference): each format at each level
 * this process runs (tests/common/levels.h) against the scalar level, the
 * oracle, in the codec and in attention:
 *   encode     the same status and the same record bytes (docs/kvarn-codec.md
 *              "SIMD": every level gives the same bytes; the per-token
 *              encoders have no SIMD copy);
 *   decode     the scalar record decoded to the same fp32 bits (the
 *              AVX2 Hadamard is bit-identical to the scalar one,
 *              src/codec/hadamard.h), in both bases for KVarN;
 *   attention  decode and causal multi-query calls over a paged fixture
 *              (sink page, committed records, fp16 tail, a partial block)
 *              within 2e-4 of the row's largest output where
 *              kvarn_attn_kernel_info says fp32: test_attn holds every
 *              level's fp32 kernels to 1e-4 of the double-precision
 *              attention over the same dequantized K/V, so two levels are
 *              within twice that of each other (1e-5, test_simd_threads'
 *              allowance for its data, is exceeded here by 8-bit keys of
 *              128-token tiles at D 128: 1.06x); plus the derived integer
 *              error (tests/common/int_dot_bound.h) where it names an
 *              integer half; and for KVarN the matrix kernel, forced to
 *              its emulation (testing knob amx = 2, attn.h) at every
 *              level, against the same oracle within that allowance plus
 *              its derived bf16 bound.
 * The formats are the format table's rows (kvarn_format_name_at) and every
 * KVarN name kvarn_format_accepted_names describes
 * (kvarn_k{2,4,8}v{2,4,8}_g{32,64,128}, with and without the centred "c");
 * the kernel table's rows (src/attn/kernel_table.c) are those formats'
 * kinds, and every kind row's kernel at every level walked must have run
 * (the level each pass selects is the table's, attn_select_kernels). */
#define KVARN_EXPERIMENTAL_API /* the testing knobs (attn.h) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "attn/attn_internal.h"
#include "common/int_dot_bound.h"
#include "common/levels.h"
#include "common/paged_fixture.h"
#include "kvarn/attn.h"

#define MAX_FORMATS 96
#define HK 2
#define GROUP 4
#define N_SEQS 2

/* The formats walked (names kvarn_format_parse takes). */
static int list_formats(char names[][32])
{
    int n = 0;
    for (int i = 0; i < kvarn_format_count(); i++) snprintf(names[n++], 32, "%s", kvarn_format_name_at(i));
    /* the KVarN pattern of kvarn_format_accepted_names; the table's
     * presets are among them, and not walked twice */
    assert_non_null(strstr(kvarn_format_accepted_names(), "kvarn_k{2,4,8}v{2,4,8}_g{32,64,128}"));
    static const int bits[3] = {2, 4, 8}, tiles[3] = {32, 64, 128};
    for (int c = 0; c < 2; c++)
        for (int kb = 0; kb < 3; kb++)
            for (int vb = 0; vb < 3; vb++)
                for (int g = 0; g < 3; g++) {
                    char name[32];
                    snprintf(name, sizeof name, "kvarn_k%dv%d_g%d%s", bits[kb], bits[vb], tiles[g],
                             c ? "c" : "");
                    int seen = 0;
                    for (int i = 0; i < n; i++) seen |= strcmp(names[i], name) == 0;
                    if (seen) continue;
                    assert_true(n < MAX_FORMATS);
                    snprintf(names[n++], 32, "%s", name);
                }
    return n;
}

/* The level whose kernel of kind's row runs at walk level lv for D: the
 * table's selection, then the first non-NULL entry at or below it
 * (kernel_table.c attn_select_arith_from). */
static int row_level(kvarn_kind kind, int D, int lv)
{
    attn_kernels k;
    int sel = attn_select_kernels(kind, D, lv, &k);
    assert_true(sel >= 0);
    const attn_kind_row *row = attn_kind_row_of(kind);
    while (sel > 0 && row->token_tile[sel] == NULL && row->record_tile[sel] == NULL) sel--;
    return sel;
}

/* One attention call of the fixture: decode (one query per sequence) or
 * causal multi-query with qsl; amx: the testing knob. */
static void run_attn(const paged_fixture *f, int multi, const int32_t *qsl, int amx, const float *q,
                     float *out)
{
    const int Hq = HK * GROUP;
    kvarn_attn_opts o = KVARN_ATTN_OPTS_DEFAULT((float)(1.0 / sqrt((double)f->D)));
    o.causal = 1;
    kvarn_attn_testing knobs = {0, 0, 0, amx, 0};
    o.testing = &knobs;
    const int total_q = multi ? qsl[N_SEQS] : N_SEQS;
    const size_t wsz = kvarn_attn_workspace_bytes(&f->kv, Hq, N_SEQS, total_q, 1, &o);
    assert_true(wsz > 0);
    void *ws = malloc(wsz);
    assert_non_null(ws);
    const kvarn_status st = multi
        ? kvarn_attn_multi(&f->kv, f->views, N_SEQS, qsl, Hq, q, out, &o, NULL, ws, wsz)
        : kvarn_attn_decode(&f->kv, f->views, N_SEQS, Hq, q, out, &o, NULL, ws, wsz);
    free(ws);
    assert_int_equal(st, KVARN_OK);
}

/* max |v| over sequence s's dequantized V in the original basis (KVarN:
 * rotated back): the vmax of attn_int_dot_bound, over every position (a
 * bound over more positions is larger, so still a bound). */
static double vmax_original(const paged_fixture *f, int s)
{
    const int D = f->D;
    double m = 0.0, y[1024];
    const size_t n = (size_t)f->views[s].seq_len * f->Hk;
    for (size_t i = 0; i < n; i++) {
        for (int d = 0; d < D; d++) y[d] = f->v_deq[s][i * D + d];
        if (f->fmt.kind == KVARN_KIND_KVARN) pf_hadamard_d(y, D);
        for (int d = 0; d < D; d++) m = fmax(m, fabs(y[d]));
    }
    return m;
}

/* Every output row of a call against the oracle's: within 2e-4 of the
 * row's largest output plus the derived integer error of the kernels this
 * level runs (idb_amx says which matrix kernel). Returns the largest
 * error / limit; *max_ib gets the largest integer (or bf16) bound. */
static double check_rows(const paged_fixture *f, int multi, const int32_t *qsl, const float *q,
                         const float *ref, const float *out, const double *vmax, const char *what,
                         double *max_ib)
{
    *max_ib = 0.0;
    const int D = f->D, Hq = HK * GROUP;
    const int rows_tok = multi ? qsl[N_SEQS] : N_SEQS;
    double worst = 0.0;
    for (int tok = 0; tok < rows_tok; tok++) {
        int s = 0;
        if (multi)
            while (tok >= qsl[s + 1]) s++;
        else
            s = tok;
        const int len = f->views[s].seq_len;
        const int pos = multi ? len - (qsl[s + 1] - qsl[s]) + (tok - qsl[s]) : len - 1;
        for (int head = 0; head < Hq; head++) {
            const size_t row = (size_t)tok * Hq + head;
            double mx = 0.0, err = 0.0;
            for (int d = 0; d < D; d++) {
                mx = fmax(mx, fabs(ref[row * D + d]));
                err = fmax(err, fabs((double)out[row * D + d] - ref[row * D + d]));
            }
            const double ib = attn_int_dot_bound(&f->kv, &f->views[s], head / GROUP, q + row * D,
                                                 1.0 / sqrt((double)D), 0, pos, vmax[s]);
            const double lim = 2e-4 * mx + ib;
            *max_ib = fmax(*max_ib, ib);
            if (!(err <= lim))
                print_error("%s D=%d %s row %zu: error %g, limit %g (int bound %g)\n", f->fmt.name, D,
                            what, row, err, lim, ib);
            assert_true(err <= lim);
            if (lim > 0.0) worst = fmax(worst, err / lim);
        }
    }
    return worst;
}

/* The KVARN_SIMD names of levels.h are the kernel table's level rows, in
 * order; each pass of a walk runs at its level (kvarn_simd_level,
 * kvarn_attn_kernel_name); and the walk puts back what it found, as a
 * held level (levels_hold, capped at the top) does. */
static void test_level_names(void **state)
{
    (void)state;
    assert_int_equal(ATTN_LEVELS, LEVELS_MAX);
    for (int i = 0; i < ATTN_LEVELS; i++) assert_string_equal(attn_level_row_of(i)->name, levels_names[i]);
    const char *outer = getenv("KVARN_SIMD");
    char *saved = outer ? strdup(outer) : NULL;
    int passes = 0;
    LEVELS_FOR(it) {
        const char *now = NULL;
        assert_int_equal(kvarn_simd_level(&now), KVARN_OK);
        assert_string_equal(now, it.name);
        assert_string_equal(kvarn_attn_kernel_name(NULL), it.name);
        assert_int_equal(it.index, passes++);
    }
    assert_int_equal(passes, levels_top() + 1);
    if (saved) assert_string_equal(getenv("KVARN_SIMD"), saved);
    else assert_null(getenv("KVARN_SIMD"));
    /* unset, a cap and a value that names no level all come back; an
     * early exit through levels_end too; an inner walk stops at the
     * outer pass's level; a held level is capped at the top */
    const char *outers[3] = {NULL, "scalar", "bogus"};
    for (int i = 0; i < 3; i++) {
        if (outers[i]) setenv("KVARN_SIMD", outers[i], 1);
        else unsetenv("KVARN_SIMD");
        LEVELS_FOR(it) {
            int inner = 0;
            LEVELS_FOR(in) inner++;
            assert_int_equal(inner, it.index + 1);
            assert_string_equal(getenv("KVARN_SIMD"), it.name);
        }
        LEVELS_FOR(it) {
            levels_end(&it);
            break;
        }
        const int top = levels_top();
        for (int l = 0; l < LEVELS_MAX; l++) {
            levels_iter held = levels_hold(l);
            const int want = l < top ? l : top;
            const char *now = NULL;
            assert_int_equal(held.index, want);
            assert_string_equal(held.name, levels_names[want]);
            assert_int_equal(kvarn_simd_level(&now), KVARN_OK);
            assert_string_equal(now, levels_names[want]);
            levels_end(&held);
            levels_end(&held);
        }
        levels_iter none = LEVELS_NONE;
        levels_end(&none);
        if (outers[i]) assert_string_equal(getenv("KVARN_SIMD"), outers[i]);
        else assert_null(getenv("KVARN_SIMD"));
    }
    if (saved) setenv("KVARN_SIMD", saved, 1);
    else unsetenv("KVARN_SIMD");
    free(saved);
}

/* The walk of the file's comment. */
static void test_formats_rows_levels(void **state)
{
    (void)state;
    static char names[MAX_FORMATS][32];
    const int n_formats = list_formats(names);
    int hit[KVARN_KIND_COUNT][ATTN_LEVELS], kinds[KVARN_KIND_COUNT];
    memset(hit, 0, sizeof hit);
    memset(kinds, 0, sizeof kinds);
    int n_levels = 0, n_runs = 0;
    double worst = 0.0, worst_matrix = 0.0;
    test_rng rng;
    test_rng_seed(&rng, 4545);
    for (int fi = 0; fi < n_formats; fi++) {
        kvarn_format fmt;
        assert_int_equal(kvarn_format_parse(names[fi], &fmt), KVARN_OK);
        kinds[fmt.kind]++;
        const int kvarn = fmt.kind == KVARN_KIND_KVARN;
        /* the table's rows at D 64 and 128, the other KVarN names at one
         * of them (each a specialization of the SIMD record kernels; the
         * time under the sanitizers) */
        for (int D = 64; D <= 128; D += 64) {
            if (fi >= kvarn_format_count() && (D == 64) != (fi % 2 == 0)) continue;
            /* codec: one record's worth of K/V, a token outlier among them */
            const int G = fmt.tile_tokens;
            kvarn_record_layout L;
            assert_int_equal(kvarn_record_layout_get(&fmt, D, &L), KVARN_OK);
            const size_t nkv = (size_t)G * D, rb = L.record_bytes;
            const size_t wsb = kvarn_encode_workspace_bytes(&fmt, D);
            float *k = malloc(nkv * sizeof(float)), *v = malloc(nkv * sizeof(float));
            float *dk[2][2], *dv[2][2]; /* [oracle, this level][basis] */
            uint8_t *rec = malloc(rb), *rec2 = malloc(rb);
            void *ws = wsb ? aligned_alloc(64, (wsb + 63) / 64 * 64) : NULL;
            assert_true(k && v && rec && rec2 && (ws || !wsb));
            for (int a = 0; a < 2; a++)
                for (int b = 0; b < 2; b++) {
                    dk[a][b] = malloc(nkv * sizeof(float));
                    dv[a][b] = malloc(nkv * sizeof(float));
                    assert_true(dk[a][b] && dv[a][b]);
                }
            for (size_t i = 0; i < nkv; i++) {
                k[i] = (float)test_rng_normal(&rng);
                v[i] = (float)(test_rng_normal(&rng) + (kvarn && fmt.centred ? 3.0 : 0.0));
            }
            for (int d = 0; d < D; d++) k[(size_t)(G / 2) * D + d] *= 40.0f;
            kvarn_status want = KVARN_OK;

            /* attention: a sink page, committed records (or blocks), an
             * fp16 tail tile and a partial tile or block */
            const int B = kvarn ? G : 16;
            pf_seq_spec seqs[N_SEQS] = {{3 * B + 7, kvarn ? 1 : 0}, {B + B / 2 + 1, 0}};
            paged_fixture f;
            assert_int_equal(pf_build(&f, names[fi], D, HK, B, 1, seqs, N_SEQS, 4500 + fi * 2 + D), 0);
            int32_t qsl[N_SEQS + 1] = {0, 5, 7}; /* 5 x GROUP = 20 rows: the matrix kernel's 16 */
            const size_t nq = (size_t)qsl[N_SEQS] * HK * GROUP * D;
            float *q = malloc(nq * sizeof(float)), *out = malloc(nq * sizeof(float));
            float *ref[2] = {malloc(nq * sizeof(float)), malloc(nq * sizeof(float))};
            assert_true(q && out && ref[0] && ref[1]);
            for (size_t i = 0; i < nq; i++) q[i] = (float)(1.5 * test_rng_normal(&rng));
            double vmax[N_SEQS];
            for (int s = 0; s < N_SEQS; s++) vmax[s] = vmax_original(&f, s);

            LEVELS_FOR(it) {
                const int o = it.index > 0; /* 0: the oracle's pass */
                if (fi == 0 && D == 64) n_levels++;
                /* the kernels this pass runs: the level's own */
                kvarn_attn_kernel_info info;
                assert_int_equal(kvarn_attn_kernel_info_get(&fmt, D, f.kv.staging, NULL, &info), KVARN_OK);
                assert_string_equal(info.level, it.name);
                hit[fmt.kind][row_level(fmt.kind, D, it.index)] = 1;

                memset(o ? rec2 : rec, 0x5a, rb);
                const kvarn_status st = kvarn_encode(&fmt, D, k, v, o ? rec2 : rec, rb, ws, wsb, NULL);
                if (!o) want = st;
                assert_int_equal(want, KVARN_OK);
                if (o && (st != want || memcmp(rec, rec2, rb) != 0))
                    fail_msg("%s D=%d: %s encodes %s%s, scalar %s", names[fi], D, it.name,
                             kvarn_strerror(st), st == want ? " (records differ)" : "",
                             kvarn_strerror(want));
                for (int b = 0; b < 1 + kvarn; b++) {
                    assert_int_equal(kvarn_decode(&fmt, D, rec, rb, dk[o][b], dv[o][b],
                                                  b ? KVARN_DECODE_ROTATED : 0), KVARN_OK);
                    if (o && (memcmp(dk[0][b], dk[1][b], nkv * sizeof(float)) != 0 ||
                              memcmp(dv[0][b], dv[1][b], nkv * sizeof(float)) != 0))
                        fail_msg("%s D=%d: %s decodes (%s basis) to other bits than scalar", names[fi],
                                 D, it.name, b ? "rotated" : "original");
                }

                for (int multi = 0; multi < 2; multi++) {
                    idb_amx = 1;
                    run_attn(&f, multi, qsl, 1, q, o ? out : ref[multi]);
                    n_runs++;
                    if (o) {
                        char what[48];
                        snprintf(what, sizeof what, "%s %s", it.name, multi ? "multi" : "decode");
                        double ib;
                        worst = fmax(worst, check_rows(&f, multi, qsl, q, ref[multi], out, vmax, what, &ib));
                    }
                }
                if (kvarn) {
                    /* the emulated matrix kernel, at every level (the
                     * oracle's pass included), against the scalar oracle */
                    idb_amx = 2;
                    run_attn(&f, 1, qsl, 2, q, out);
                    n_runs++;
                    char what[48];
                    snprintf(what, sizeof what, "%s amx-bf16-emulated", it.name);
                    double ib;
                    worst_matrix = fmax(worst_matrix, check_rows(&f, 1, qsl, q, ref[1], out, vmax, what, &ib));
                    assert_true(ib > 0.0); /* the bf16 bound was computed */
                    idb_amx = 1;
                }
            }
            idb_amx = 0;
            free(q); free(out); free(ref[0]); free(ref[1]);
            pf_free(&f);
            for (int a = 0; a < 2; a++)
                for (int b = 0; b < 2; b++) {
                    free(dk[a][b]);
                    free(dv[a][b]);
                }
            free(k); free(v); free(rec); free(rec2); free(ws);
        }
    }
    /* every kind row of the kernel table was walked, and each row's
     * kernel at every level walked ran */
    int entries = 0;
    for (int kd = 0; kd < KVARN_KIND_COUNT; kd++) {
        if (kinds[kd] == 0) fail_msg("kernel table row %d: no format walked", kd);
        const attn_kind_row *row = attn_kind_row_of((kvarn_kind)kd);
        for (int lv = 0; lv < n_levels; lv++) {
            if (row->token_tile[lv] == NULL && row->record_tile[lv] == NULL) continue;
            if (!hit[kd][lv]) fail_msg("kernel table row %d: its %s kernel never ran", kd, levels_names[lv]);
            entries++;
        }
    }
    print_message("%d formats x %d kernel-table rows (%d row kernels) x %d levels (up to %s): "
                  "%d attention calls; worst error / limit %.3f, matrix (emulated) %.3f\n",
                  n_formats, KVARN_KIND_COUNT, entries, n_levels, levels_names[n_levels - 1], n_runs,
                  worst, worst_matrix);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_level_names, levels_teardown),
        cmocka_unit_test_teardown(test_formats_rows_levels, levels_teardown),
    };
    if (getenv("KVARN_TEST_FILTER")) cmocka_set_test_filter(getenv("KVARN_TEST_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
