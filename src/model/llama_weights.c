/*
 * llama_weights.c -- the weight matrices of the llama runner in the
 * precision chosen at load, and the one matmul the forward pass calls.
 *
 *   fp32  [out][in] floats; OpenBLAS sgemv (one token) or sgemm.
 *   bf16  bf16 (fp32 rounded to nearest even), filled [out][in] and then
 *         reordered once into the blocked layout oneDNN's matmul asks for
 *         (libdnnl-dev, Debian 12: 2.6); src bf16 [M][in], dst fp32
 *         [M][out], two primitives per matrix: M = 1 (a decode step) and
 *         M = LLAMA_MM_BLOCK (chunks, in blocks). The activations are
 *         rounded to bf16 at each matmul's input (oneDNN 2.6 has no fp32 x
 *         bf16 matmul); products are exact in fp32 and summed in fp32.
 *   int8  per row (output channel) j: scale s_j = max_i |w_ji| / 127,
 *         codes q_ji = round(w_ji / s_j) in [-127, 127] (round to nearest,
 *         ties to even); the activations per row (token) t likewise,
 *         x_ti ~ c_t p_ti, c_t = max_i |x_ti| / 127, at each matmul's input.
 *         oneDNN's s8 x s8 matmul sums p q exactly in int32 (K 127^2 <
 *         2^31 for K < 133,000) and scales by s_j (its per-channel output
 *         scales), then each row is scaled by c_t here. Same primitives,
 *         layout and blocks as bf16; 1 byte/weight plus 4 per row.
 * Why fixed M and the blocked layout: with M given per call (runtime dims)
 * oneDNN 2.6 runs its generic gemm on the plain layout, which repacks the
 * weights as it goes; its brgemm kernels need M fixed, and on a runtime-M
 * or plain-layout request they are not taken (runtime M over the blocked
 * layout falls to the reference kernel). A decode step streams every
 * weight once, so the layout decides its speed (docs/model.md "Weight
 * precision", bench/bench_matmul.c --stream).
 * Why oneDNN: Debian's OpenBLAS 0.3.21 is built without BUILD_BFLOAT16
 * (cblas_sbgemm is declared, not exported), and oneDNN's bf16 matmul ran
 * 1.9x-2.2x fp32 OpenBLAS at one token and 1.9x-2.0x at 128 on SmolLM2's
 * shapes (bench/bench_matmul.c; docs/model.md "Weight precision").
 * The primitives are made at load and only read afterwards, with a user
 * scratchpad that each session owns, so sessions on different threads can
 * share a model.
 *   gguf  each matrix whose tensors are Q4_0, Q4_1 or Q8_0 kept as the
 *         file's own blocks (SmolLM2: 97 MB against bf16's 270 MB read per
 *         token); one token through the GEMV of llama_qgemv.h (weights
 *         dequantized exactly as src/gguf/dequant.c, fp32 activations and
 *         sums: the fp32 model, only the summation order differs), its rows
 *         split over the session's pool; a chunk dequantizes LLAMA_MM_SLAB
 *         rows at a time into the session's slab and multiplies them with
 *         OpenBLAS sgemm. Matrices of other types are held in fp32.
 */
#include <cblas.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attn/attn_internal.h"
#include "common/checked.h"
#include "common/cpu.h"
#include "model/llama_internal.h"
#include "model/llama_qgemv.h"

#ifdef KVARN_HAVE_DNNL
#include <oneapi/dnnl/dnnl.h>
#endif

/* One row of in floats as int8 codes q (round to nearest even, |q| <= 127)
 * times the returned scale max |x| / 127. A row whose max is below FLT_MIN
 * (zero, or subnormal only) gets scale 0 and codes 0; a row holding an
 * infinity or a NaN gets codes 0 and a NaN scale, so that its products are
 * NaN as they would be unquantized. */
static float quantize_row(const float *x, int in, int8_t *q)
{
    float amax = 0.0f;
    int nan = 0;
    for (int i = 0; i < in; i++) {
        amax = fmaxf(amax, fabsf(x[i]));
        nan |= x[i] != x[i];
    }
    if (nan || !(amax >= FLT_MIN && amax <= FLT_MAX)) {
        for (int i = 0; i < in; i++) q[i] = 0;
        return nan || amax > FLT_MAX ? NAN : 0.0f;
    }
    float inv = 127.0f / amax;
    for (int i = 0; i < in; i++) {
        float v = rintf(x[i] * inv); /* |v| <= 127 but for inv's rounding */
        q[i] = (int8_t)(v >= 127.0f ? 127 : v <= -127.0f ? -127 : (int)v);
    }
    return amax / 127.0f;
}

kvarn_status llama_matrix_alloc(kvarn_llama *model, llama_matrix *m, int out, int in)
{
    memset(m, 0, sizeof *m);
    m->out = out;
    m->in = in;
    /* out * in * 4 fits size_t with 64 to spare (weight_sizes_get). */
    size_t n = (size_t)out * (size_t)in;
    if (model->weights == KVARN_LLAMA_WEIGHTS_BF16) {
        size_t bytes = (n * sizeof(uint16_t) + 63) & ~(size_t)63;
        m->bf16 = kvarn__malloc_aligned(&model->alloc, bytes ? bytes : 64, 64, 0);
        return m->bf16 ? KVARN_OK : KVARN_ERR_NOMEM;
    }
    if (model->weights == KVARN_LLAMA_WEIGHTS_INT8) {
        size_t bytes = (n + 63) & ~(size_t)63;
        m->s8 = kvarn__malloc_aligned(&model->alloc, bytes ? bytes : 64, 64, 0);
        m->wscale = kvarn__malloc(&model->alloc, out > 0 ? (size_t)out : 1, sizeof(float));
        if (m->s8 && m->wscale) return KVARN_OK;
        kvarn__free_aligned(&model->alloc, m->s8);
        kvarn__free(&model->alloc, m->wscale);
        m->s8 = NULL;
        m->wscale = NULL;
        return KVARN_ERR_NOMEM;
    }
    size_t bytes = (n * sizeof(float) + 63) & ~(size_t)63;
    m->f32 = kvarn__malloc_aligned(&model->alloc, bytes ? bytes : 64, 64, 0);
    return m->f32 ? KVARN_OK : KVARN_ERR_NOMEM;
}

kvarn_status llama_matrix_alloc_q(kvarn_llama *model, llama_matrix *m, int out, int in,
                                  kvarn_ggml_type type)
{
    memset(m, 0, sizeof *m);
    if (!llama_qtype_served(type)) return KVARN_ERR_UNSUPPORTED;
    if (out < 1 || in < 1 || in % LLAMA_QK) return KVARN_ERR_BAD_FILE;
    uint64_t rb = kvarn_ggml_row_bytes(type, (uint64_t)in), total;
    /* fewer bytes than the fp32 copy weight_sizes_get already bounded */
    if (rb == 0 || kvarn__mul_u64(rb, (uint64_t)out, &total) || total > SIZE_MAX - 64)
        return KVARN_ERR_TOO_LARGE;
    m->q = kvarn__malloc_aligned(&model->alloc, ((size_t)total + 63) & ~(size_t)63, 64, 0);
    if (!m->q) return KVARN_ERR_NOMEM;
    m->out = out;
    m->in = in;
    m->row_bytes = (size_t)rb;
    m->qtype = type;
    return KVARN_OK;
}

kvarn_status llama_matrix_set_q_rows(llama_matrix *m, int r0, int rows, kvarn_ggml_type type,
                                     const void *src, uint64_t bytes)
{
    if (!m->q || r0 < 0 || rows < 1 || r0 > m->out - rows || !src) return KVARN_ERR_INVALID_ARG;
    if (type != m->qtype || bytes != (uint64_t)rows * m->row_bytes) return KVARN_ERR_BAD_FILE;
    memcpy(m->q + (size_t)r0 * m->row_bytes, src, (size_t)bytes);
    return KVARN_OK;
}

void llama_matrix_set_rows(llama_matrix *m, int r0, int rows, const float *src)
{
    size_t off = (size_t)r0 * m->in, cnt = (size_t)rows * m->in;
    if (m->f32) {
        memcpy(m->f32 + off, src, cnt * sizeof(float));
        return;
    }
    if (m->s8) {
        for (int r = 0; r < rows; r++)
            m->wscale[r0 + r] = quantize_row(src + (size_t)r * m->in, m->in,
                                             m->s8 + off + (size_t)r * m->in);
        return;
    }
    for (size_t i = 0; i < cnt; i++) m->bf16[off + i] = kvarn_fp32_to_bf16(src[i]);
}

void llama_matrix_get_row(const llama_matrix *m, int r, float *dst)
{
    if (m->q) {
        /* dequant.c itself: the embedding row as the fp32 model holds it */
        kvarn_ggml_dequantize(m->qtype, m->q + (size_t)r * m->row_bytes, dst, (uint64_t)m->in);
        return;
    }
    size_t off = (size_t)r * m->in;
    if (m->f32) {
        memcpy(dst, m->f32 + off, sizeof(float) * (size_t)m->in);
        return;
    }
    if (m->s8) {
        for (int i = 0; i < m->in; i++) dst[i] = (float)m->s8[off + i] * m->wscale[r];
        return;
    }
    if (!m->bf16) return; /* prepared without keep_rows: not callable */
    for (int i = 0; i < m->in; i++) dst[i] = kvarn_bf16_to_fp32(m->bf16[off + i]);
}

#ifdef KVARN_HAVE_DNNL

static kvarn_status from_dnnl(dnnl_status_t s)
{
    return s == dnnl_success ? KVARN_OK
         : s == dnnl_out_of_memory ? KVARN_ERR_NOMEM : KVARN_ERR_UNSUPPORTED;
}

/* 1 when oneDNN's int8 matmul sums exactly on this CPU: with VNNI
 * (AVX-512 VNNI or AVX-VNNI, vpdpbusd: u8 x s8 products summed in int32).
 * Without it oneDNN falls back to vpmaddubsw, whose u8 x s8 pair sums
 * saturate at int16: codes of +-127 (255 x 127 x 2 = 64770 > 32767) give
 * errors of ~1% of an output (measured on an AVX2-only EPYC with oneDNN
 * 2.6: 14.24 for an exact 14.44; oneDNN's developer guide, "Nuances of
 * int8 Computations", describes the limit). */
static int dnnl_int8_exact(void)
{
    unsigned isa = (unsigned)dnnl_get_effective_cpu_isa();
    unsigned v512 = (unsigned)dnnl_cpu_isa_avx512_core_vnni;
    unsigned v256 = (unsigned)dnnl_cpu_isa_avx2_vnni;
    return (isa & v512) == v512 || (isa & v256) == v256;
}

kvarn_status llama_weights_engine_create(kvarn_llama *model)
{
    if (model->weights == KVARN_LLAMA_WEIGHTS_INT8 && !dnnl_int8_exact())
        return KVARN_ERR_UNSUPPORTED;
    dnnl_engine_t e = NULL;
    kvarn_status st = from_dnnl(dnnl_engine_create(&e, dnnl_cpu, 0));
    if (st != KVARN_OK) return st;
    model->engine = e;
    return KVARN_OK;
}

void llama_weights_engine_destroy(kvarn_llama *model)
{
    if (model->engine) dnnl_engine_destroy((dnnl_engine_t)model->engine);
    model->engine = NULL;
}

/* The matrix's element type in oneDNN's terms. */
static dnnl_data_type_t wtype(const llama_matrix *m)
{
    return m->s8 || m->wscale ? dnnl_s8 : dnnl_bf16;
}

/* A matmul primitive src [rows][in] x weights (wmd; "any" lets oneDNN
 * choose) -> dst f32 [rows][out], user scratchpad; bf16 x bf16, or s8 x s8
 * with the rows' scales as per-channel output scales. */
static kvarn_status make_prim(dnnl_engine_t eng, const llama_matrix *m, int rows,
                              const dnnl_memory_desc_t *wmd, dnnl_primitive_desc_t *pd_out,
                              dnnl_primitive_t *prim_out)
{
    dnnl_memory_desc_t smd, dmd;
    dnnl_dims_t sd = {rows, m->in}, dd = {rows, m->out};
    dnnl_matmul_desc_t md;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_primitive_t prim = NULL;
    kvarn_status st = from_dnnl(dnnl_memory_desc_init_by_tag(&smd, 2, sd, wtype(m), dnnl_ab));
    if (!st) st = from_dnnl(dnnl_memory_desc_init_by_tag(&dmd, 2, dd, dnnl_f32, dnnl_ab));
    if (!st) st = from_dnnl(dnnl_matmul_desc_init(&md, &smd, wmd, NULL, &dmd));
    if (!st) st = from_dnnl(dnnl_primitive_attr_create(&attr));
    if (!st) st = from_dnnl(dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user));
    if (!st && m->wscale) /* mask 1 << 1: one scale per column of [rows][out] */
        st = from_dnnl(dnnl_primitive_attr_set_output_scales(attr, m->out, 1 << 1, m->wscale));
    if (!st) st = from_dnnl(dnnl_primitive_desc_create(&pd, &md, attr, eng, NULL));
    if (!st) st = from_dnnl(dnnl_primitive_create(&prim, pd));
    if (attr) dnnl_primitive_attr_destroy(attr);
    if (st) {
        if (pd) dnnl_primitive_desc_destroy(pd);
        return st;
    }
    *pd_out = pd;
    *prim_out = prim;
    return KVARN_OK;
}

static size_t scratch_of(const_dnnl_primitive_desc_t pd)
{
    const dnnl_memory_desc_t *sp = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    return sp ? dnnl_memory_desc_get_size(sp) : 0;
}

/* Copy the plain weights (oneDNN's "ba" over [in][out]) into dst laid out
 * as wmd, through a reorder primitive on a stream of its own. */
static kvarn_status reorder_in(dnnl_engine_t eng, const llama_matrix *m,
                               const dnnl_memory_desc_t *wmd, void *dst)
{
    dnnl_memory_desc_t pmd;
    dnnl_dims_t wd = {m->in, m->out};
    dnnl_memory_t from = NULL, to = NULL;
    dnnl_primitive_desc_t rpd = NULL;
    dnnl_primitive_t r = NULL;
    dnnl_stream_t strm = NULL;
    kvarn_status st = from_dnnl(dnnl_memory_desc_init_by_tag(&pmd, 2, wd, wtype(m), dnnl_ba));
    if (!st) st = from_dnnl(dnnl_memory_create(&from, &pmd, eng,
                                               m->s8 ? (void *)m->s8 : (void *)m->bf16));
    if (!st) st = from_dnnl(dnnl_memory_create(&to, wmd, eng, dst));
    if (!st) st = from_dnnl(dnnl_reorder_primitive_desc_create(&rpd, &pmd, eng, wmd, eng, NULL));
    if (!st) st = from_dnnl(dnnl_primitive_create(&r, rpd));
    if (!st) st = from_dnnl(dnnl_stream_create(&strm, eng, dnnl_stream_default_flags));
    if (!st) {
        dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to}};
        st = from_dnnl(dnnl_primitive_execute(r, strm, 2, args));
        if (!st) st = from_dnnl(dnnl_stream_wait(strm));
    }
    if (strm) dnnl_stream_destroy(strm);
    if (r) dnnl_primitive_destroy(r);
    if (rpd) dnnl_primitive_desc_destroy(rpd);
    if (to) dnnl_memory_destroy(to);
    if (from) dnnl_memory_destroy(from);
    return st;
}

kvarn_status llama_matrix_prepare(kvarn_llama *model, llama_matrix *m, int keep_rows)
{
    if (!m->bf16 && !m->s8) return KVARN_OK;
    dnnl_engine_t eng = (dnnl_engine_t)model->engine;
    dnnl_memory_desc_t any;
    dnnl_dims_t wd = {m->in, m->out};
    dnnl_primitive_desc_t pd1 = NULL, pdb = NULL;
    dnnl_primitive_t p1 = NULL, pb = NULL;
    dnnl_memory_t wmem = NULL;
    void *blk = NULL;
    size_t blk_bytes = 0;
    /* The M = 1 primitive chooses the layout; the block primitive is made
     * over that same layout (one copy of the weights serves both). */
    kvarn_status st = from_dnnl(dnnl_memory_desc_init_by_tag(&any, 2, wd, wtype(m),
                                                             dnnl_format_tag_any));
    if (!st) st = make_prim(eng, m, 1, &any, &pd1, &p1);
    const dnnl_memory_desc_t *wmd = st ? NULL : dnnl_primitive_desc_query_md(pd1, dnnl_query_weights_md, 0);
    if (!st && !wmd) st = KVARN_ERR_UNSUPPORTED;
    if (!st) st = make_prim(eng, m, LLAMA_MM_BLOCK, wmd, &pdb, &pb);
    if (!st) {
        blk_bytes = dnnl_memory_desc_get_size(wmd);
        blk = kvarn__malloc_aligned(&model->alloc, blk_bytes ? blk_bytes : 64, 64, 0);
        if (!blk) st = KVARN_ERR_NOMEM;
    }
    if (!st) st = reorder_in(eng, m, wmd, blk);
    if (!st) st = from_dnnl(dnnl_memory_create(&wmem, wmd, eng, blk));
    if (!st) {
        size_t s1 = scratch_of(pd1), sb = scratch_of(pdb);
        m->scratch_bytes = s1 > sb ? s1 : sb;
        if (m->scratch_bytes > model->scratch_bytes) model->scratch_bytes = m->scratch_bytes;
        if (m->out > model->max_out) model->max_out = m->out;
        m->prim1 = p1;
        m->primb = pb;
        m->wmem = wmem;
        m->blk = blk;
        m->blk_bytes = blk_bytes;
        p1 = pb = NULL;
        wmem = NULL;
        blk = NULL;
        if (!keep_rows) {
            kvarn__free_aligned(&model->alloc, m->bf16);
            kvarn__free_aligned(&model->alloc, m->s8);
            m->bf16 = NULL;
            m->s8 = NULL;
        }
    }
    kvarn__free_aligned(&model->alloc, blk);
    if (wmem) dnnl_memory_destroy(wmem);
    if (p1) dnnl_primitive_destroy(p1);
    if (pb) dnnl_primitive_destroy(pb);
    if (pd1) dnnl_primitive_desc_destroy(pd1);
    if (pdb) dnnl_primitive_desc_destroy(pdb);
    return st;
}

static void matrix_release_dnnl(llama_matrix *m)
{
    if (m->wmem) dnnl_memory_destroy((dnnl_memory_t)m->wmem);
    if (m->prim1) dnnl_primitive_destroy((dnnl_primitive_t)m->prim1);
    if (m->primb) dnnl_primitive_destroy((dnnl_primitive_t)m->primb);
    m->wmem = NULL;
    m->prim1 = NULL;
    m->primb = NULL;
}

#else /* no oneDNN: bf16 weights cannot be served */

kvarn_status llama_weights_engine_create(kvarn_llama *model)
{
    (void)model;
    return KVARN_ERR_UNSUPPORTED;
}

void llama_weights_engine_destroy(kvarn_llama *model) { (void)model; }

kvarn_status llama_matrix_prepare(kvarn_llama *model, llama_matrix *m, int keep_rows)
{
    (void)model;
    (void)keep_rows;
    return m->bf16 || m->s8 ? KVARN_ERR_UNSUPPORTED : KVARN_OK;
}

static void matrix_release_dnnl(llama_matrix *m) { (void)m; }

#endif

void llama_matrix_free(kvarn_llama *model, llama_matrix *m)
{
    matrix_release_dnnl(m);
    kvarn__free_aligned(&model->alloc, m->f32);
    kvarn__free_aligned(&model->alloc, m->bf16);
    kvarn__free_aligned(&model->alloc, m->s8);
    kvarn__free(&model->alloc, m->wscale);
    kvarn__free_aligned(&model->alloc, m->blk);
    kvarn__free_aligned(&model->alloc, m->q);
    m->q = NULL;
    m->f32 = NULL;
    m->bf16 = NULL;
    m->s8 = NULL;
    m->wscale = NULL;
    m->blk = NULL;
}

/* Rows of the ctx's activations: a chunk of 1 < n < LLAMA_MM_BLOCK rows is
 * padded to a whole block. */
static int xb_rows(int max_chunk)
{
    return max_chunk > 1 && max_chunk < LLAMA_MM_BLOCK ? LLAMA_MM_BLOCK : max_chunk;
}

/* gguf weights: the slab of dequantized rows a chunk multiplies (0 for
 * max_chunk 1), checked to fit size_t with its 64-byte rounding and
 * kvarn__malloc_aligned's slack. */
static kvarn_status gguf_slab_bytes(int max_chunk, int max_in, uint64_t *slab)
{
    *slab = 0;
    if (max_chunk > 1 &&
        (kvarn__mul3_u64(LLAMA_MM_SLAB, (uint64_t)max_in, sizeof(float), slab) ||
         *slab > SIZE_MAX - 256))
        return KVARN_ERR_TOO_LARGE;
    return KVARN_OK;
}

kvarn_status llama_mm_ctx_plan(const kvarn_llama *model, int max_chunk, int max_in,
                               int threads, uint64_t *bytes)
{
    *bytes = 0;
    if (model->weights == KVARN_LLAMA_WEIGHTS_FP32) return KVARN_OK;
    if (model->weights == KVARN_LLAMA_WEIGHTS_GGUF) {
        uint64_t slab;
        kvarn_status st = gguf_slab_bytes(max_chunk, max_in, &slab);
        if (st != KVARN_OK) return st;
        /* as allocated: rounded to 64 bytes, plus kvarn__malloc_aligned's
         * alignment slack and pointer (slab <= SIZE_MAX - 256: fits) */
        if (slab) slab = ((slab + 63) & ~(uint64_t)63) + 64 + sizeof(void *);
        /* the GEMV's pool (llama_mm_ctx_create makes it for threads > 1) */
        *bytes = slab + (threads > 1 ? kvarn__thread_pool_bytes(threads) : 0);
        return KVARN_OK;
    }
    const int q8 = model->weights == KVARN_LLAMA_WEIGHTS_INT8;
    uint64_t xb, yp = 0, total;
    /* bf16 activations, or int8 codes and one float scale per row */
    int bad = kvarn__mul3_u64((uint64_t)xb_rows(max_chunk),
                              (uint64_t)max_in + (q8 ? sizeof(float) : 0),
                              q8 ? 1u : sizeof(uint16_t), &xb);
    if (max_chunk > 1)
        bad |= kvarn__mul3_u64(LLAMA_MM_BLOCK, (uint64_t)model->max_out, sizeof(float), &yp);
    bad |= kvarn__add_u64(xb, (uint64_t)model->scratch_bytes, &total);
    bad |= kvarn__add_u64(total, yp, &total);
    bad |= total > SIZE_MAX - 192;
    if (bad) return KVARN_ERR_TOO_LARGE;
    *bytes = total;
    return KVARN_OK;
}

kvarn_status llama_mm_ctx_create(const kvarn_llama *model, const kvarn_allocator *a,
                                 int max_chunk, int max_in, int threads, llama_mm_ctx *c)
{
    memset(c, 0, sizeof *c);
    if (model->weights == KVARN_LLAMA_WEIGHTS_FP32) return KVARN_OK;
    if (model->weights == KVARN_LLAMA_WEIGHTS_GGUF) {
        uint64_t slab;
        kvarn_status st = gguf_slab_bytes(max_chunk, max_in, &slab);
        if (st != KVARN_OK) return st;
        if (slab) {
            c->slab = kvarn__malloc_aligned(a, ((size_t)slab + 63) & ~(size_t)63, 64, 0);
            if (!c->slab) return KVARN_ERR_NOMEM;
        }
        if (threads > 1) st = kvarn_thread_pool_create_ex(threads, a, &c->pool);
        if (st != KVARN_OK) llama_mm_ctx_destroy(a, c);
        return st;
    }
    (void)threads;
#ifdef KVARN_HAVE_DNNL
    uint64_t total;
    kvarn_status st = llama_mm_ctx_plan(model, max_chunk, max_in, threads, &total);
    if (st != KVARN_OK) return st;
    const int q8 = model->weights == KVARN_LLAMA_WEIGHTS_INT8;
    size_t rows = (size_t)xb_rows(max_chunk), xb = rows * (size_t)max_in;
    /* zeroed: the padding rows of a short chunk are multiplied too (their
     * outputs dropped), so they hold finite values from the start */
    int fail;
    if (q8) {
        c->xq = kvarn__calloc(a, xb ? xb : 1, 1);
        c->xs = kvarn__calloc(a, rows ? rows : 1, sizeof(float));
        fail = !c->xq || !c->xs;
    } else {
        c->xb = kvarn__calloc(a, xb ? xb : 1, sizeof(uint16_t));
        fail = !c->xb;
    }
    if (!fail) {
        c->scratch = kvarn__malloc_aligned(a, model->scratch_bytes ? model->scratch_bytes : 64, 64, 0);
        fail = !c->scratch;
    }
    if (max_chunk > 1 && !fail) {
        size_t yp = (size_t)LLAMA_MM_BLOCK * (size_t)model->max_out * sizeof(float);
        c->ypad = kvarn__malloc(a, yp ? yp : 1, 1);
        fail = !c->ypad;
    }
    if (fail) {
        llama_mm_ctx_destroy(a, c);
        return KVARN_ERR_NOMEM;
    }
    dnnl_stream_t strm = NULL;
    st = from_dnnl(dnnl_stream_create(&strm, (dnnl_engine_t)model->engine,
                                      dnnl_stream_default_flags));
    if (st != KVARN_OK) {
        llama_mm_ctx_destroy(a, c);
        return st;
    }
    c->stream = strm;
    return KVARN_OK;
#else
    (void)a;
    (void)max_chunk;
    (void)max_in;
    return KVARN_ERR_UNSUPPORTED;
#endif
}

void llama_mm_ctx_destroy(const kvarn_allocator *a, llama_mm_ctx *c)
{
#ifdef KVARN_HAVE_DNNL
    if (c->stream) dnnl_stream_destroy((dnnl_stream_t)c->stream);
#endif
    kvarn_thread_pool_destroy(c->pool);
    kvarn__free_aligned(a, c->slab);
    kvarn__free(a, c->xb);
    kvarn__free(a, c->xq);
    kvarn__free(a, c->xs);
    kvarn__free(a, c->ypad);
    kvarn__free_aligned(a, c->scratch);
    memset(c, 0, sizeof *c);
}

#ifdef KVARN_HAVE_DNNL
/* One call of prim (rows src rows fixed at its creation): src [rows][in]
 * (bf16 or s8, as the matrix) at xb, dst f32 [rows][out] at y. */
static kvarn_status run_prim(llama_mm_ctx *c, const llama_matrix *w, dnnl_primitive_t prim,
                             int rows, void *xb, float *y)
{
    dnnl_engine_t eng = NULL;
    const_dnnl_primitive_desc_t pd = NULL;
    if (dnnl_primitive_get_primitive_desc(prim, &pd) != dnnl_success ||
        dnnl_primitive_desc_query(pd, dnnl_query_engine, 0, &eng) != dnnl_success)
        return KVARN_ERR_UNSUPPORTED;
    dnnl_memory_desc_t smd, dmd, spmd;
    dnnl_dims_t sd = {rows, w->in}, dd = {rows, w->out}, spd = {(dnnl_dim_t)w->scratch_bytes};
    dnnl_memory_t sm = NULL, dm = NULL, spm = NULL;
    kvarn_status st = from_dnnl(dnnl_memory_desc_init_by_tag(&smd, 2, sd, wtype(w), dnnl_ab));
    if (!st) st = from_dnnl(dnnl_memory_desc_init_by_tag(&dmd, 2, dd, dnnl_f32, dnnl_ab));
    if (!st) st = from_dnnl(dnnl_memory_create(&sm, &smd, eng, xb));
    if (!st) st = from_dnnl(dnnl_memory_create(&dm, &dmd, eng, y));
    if (!st && w->scratch_bytes) {
        st = from_dnnl(dnnl_memory_desc_init_by_tag(&spmd, 1, spd, dnnl_u8, dnnl_a));
        if (!st) st = from_dnnl(dnnl_memory_create(&spm, &spmd, eng, c->scratch));
    }
    if (!st) {
        dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, sm}, {DNNL_ARG_WEIGHTS, (dnnl_memory_t)w->wmem},
                                   {DNNL_ARG_DST, dm}, {DNNL_ARG_SCRATCHPAD, spm}};
        st = from_dnnl(dnnl_primitive_execute(prim, (dnnl_stream_t)c->stream, spm ? 4 : 3, args));
        if (!st) st = from_dnnl(dnnl_stream_wait((dnnl_stream_t)c->stream));
    }
    if (spm) dnnl_memory_destroy(spm);
    if (dm) dnnl_memory_destroy(dm);
    if (sm) dnnl_memory_destroy(sm);
    return st;
}
#endif

#ifdef KVARN_HAVE_DNNL
/* int8 activations: row t of x [n][in] as codes times c_t (quantize_row). */
static void quantize_rows(llama_mm_ctx *c, const float *x, int n, int in)
{
    for (int t = 0; t < n; t++)
        c->xs[t] = quantize_row(x + (size_t)t * in, in, c->xq + (size_t)t * in);
}

/* y rows [0, rows) (activation rows r0 + t) times their scale c. */
static void scale_rows(const float *cs, int r0, int rows, int out, float *y)
{
    for (int t = 0; t < rows; t++) {
        float sc = cs[r0 + t];
        float *yr = y + (size_t)t * out;
        for (int j = 0; j < out; j++) yr[j] *= sc;
    }
}
#endif

/* Weights from which a one-token GEMV is split over the session's pool
 * (SmolLM2: gate/up, 1.77 M, and the head, 28 M; not QKV, output, down).
 * bench_decode --threads 2, fp16 cache at depth ~0, one noisy run on the
 * shared cores: 112 / 106 tok/s with this threshold, 91 / 90 splitting
 * every matrix, 85 / 84 splitting none (docs/model.md). */
#define LLAMA_QGEMV_SPLIT ((size_t)1 << 20)

/* One GEMV task: a run of rows of a gguf matrix. */
typedef struct qgemv_job {
    const llama_qkernels *k;
    const llama_matrix *w;
    const float *x;
    float *y;
    int rows_per_task;
} qgemv_job;

static void qgemv_task(void *ctx, int task, int worker)
{
    (void)worker;
    const qgemv_job *j = ctx;
    int r0 = task * j->rows_per_task;
    int rows = j->w->out - r0 < j->rows_per_task ? j->w->out - r0 : j->rows_per_task;
    if (rows > 0)
        j->k->gemv(j->w->q + (size_t)r0 * j->w->row_bytes, j->w->row_bytes, j->w->in, j->x,
                   j->y + r0, rows);
}

/* gguf weights: llama_matmul's n == 1 GEMV and n > 1 slab + sgemm. Every
 * row's value is computed by the same instructions whatever the split (a
 * row gives the same result in a pass of 4 rows as alone), so the result
 * does not depend on the thread count. */
static void matmul_q(llama_mm_ctx *c, const float *x, int n, const llama_matrix *w, float *y)
{
    const llama_qkernels *k = llama_qkernels_get(w->qtype, kvarn__cpu_level());
    if (n == 1) {
        /* Split only a matrix of at least LLAMA_QGEMV_SPLIT weights: a
         * pool run costs a wake-up and a join (condition variables, some
         * 10-20 us, more when the other core is busy), worth paying for
         * ~60 us or more of GEMV on one core (~17 G weights/s). */
        int workers = (size_t)w->out * (size_t)w->in >= LLAMA_QGEMV_SPLIT
                    ? kvarn_thread_pool_size(c->pool) : 1;
        /* tasks of whole 4-row passes, about 4 per worker for balance */
        int tasks = workers > 1 ? workers * 4 : 1;
        int per = (w->out + tasks - 1) / tasks;
        per = (per + 3) & ~3;
        qgemv_job j = {k, w, x, y, per};
        attn_pool_run(workers > 1 ? c->pool : NULL, qgemv_task, &j, (w->out + per - 1) / per);
        return;
    }
    for (int r0 = 0; r0 < w->out; r0 += LLAMA_MM_SLAB) {
        int rows = w->out - r0 < LLAMA_MM_SLAB ? w->out - r0 : LLAMA_MM_SLAB;
        k->dequant(w->q + (size_t)r0 * w->row_bytes, w->row_bytes, w->in, c->slab, rows);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, rows, w->in, 1.0f, x, w->in,
                    c->slab, w->in, 0.0f, y + r0, w->out);
    }
}

kvarn_status llama_matmul(llama_mm_ctx *c, const float *x, int n, const llama_matrix *w,
                          float *y)
{
    if (w->q) {
        matmul_q(c, x, n, w, y);
        return KVARN_OK;
    }
    if (w->f32) {
        if (n == 1)
            cblas_sgemv(CblasRowMajor, CblasNoTrans, w->out, w->in, 1.0f, w->f32, w->in,
                        x, 1, 0.0f, y, 1);
        else
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, w->out, w->in, 1.0f,
                        x, w->in, w->f32, w->in, 0.0f, y, w->out);
        return KVARN_OK;
    }
#ifdef KVARN_HAVE_DNNL
    const int q8 = w->wscale != NULL;
    if (q8) quantize_rows(c, x, n, w->in);
    else
        for (size_t i = 0, cnt = (size_t)n * (size_t)w->in; i < cnt; i++)
            c->xb[i] = kvarn_fp32_to_bf16(x[i]);
    const int B = LLAMA_MM_BLOCK;
    size_t xrow = q8 ? (size_t)w->in : (size_t)w->in * sizeof(uint16_t); /* bytes */
    char *xs = q8 ? (char *)c->xq : (char *)c->xb;
    if (n == 1) {
        kvarn_status st = run_prim(c, w, (dnnl_primitive_t)w->prim1, 1, xs, y);
        if (st == KVARN_OK && q8) scale_rows(c->xs, 0, 1, w->out, y);
        return st;
    }
    if (n < B) {
        /* one block: rows n..B-1 of the activations are left from earlier
         * calls (or zero), multiplied into ypad and dropped */
        kvarn_status st = run_prim(c, w, (dnnl_primitive_t)w->primb, B, xs, c->ypad);
        if (st != KVARN_OK) return st;
        memcpy(y, c->ypad, sizeof(float) * (size_t)n * (size_t)w->out);
        if (q8) scale_rows(c->xs, 0, n, w->out, y);
        return KVARN_OK;
    }
    /* whole blocks; the last one ends at row n (rows it shares with the
     * block before are computed and scaled again) */
    for (int r0 = 0;; r0 += B) {
        if (r0 > n - B) r0 = n - B;
        float *yb = y + (size_t)r0 * (size_t)w->out;
        kvarn_status st = run_prim(c, w, (dnnl_primitive_t)w->primb, B,
                                   xs + (size_t)r0 * xrow, yb);
        if (st != KVARN_OK) return st;
        if (q8) scale_rows(c->xs, r0, B, w->out, yb);
        if (r0 == n - B) return KVARN_OK;
    }
#else
    (void)c;
    (void)x;
    (void)n;
    (void)y;
    return KVARN_ERR_UNSUPPORTED;
#endif
}
