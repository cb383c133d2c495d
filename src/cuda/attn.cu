/*
 * attn.cu -- attention over the paged cache (decode, chunked prefill,
 * speculative verification), every format, with flash-decoding split-K.
 *
 * Work split: one thread block of 128 threads per (sequence, KV head, chunk
 * of up to 8 query rows, split). A row is one query head of the KV head's
 * GQA group for one query of the sequence, so one pass over a tile serves
 * the whole group (and several queries when verifying drafts). The block
 * walks its tiles in order with an online softmax in base 2 (the softmax
 * scale times log2(e) is folded into the query once):
 *   1. scores s[row][t] for the tile's tokens into shared memory;
 *   2. running max, rescale factor and weights p (one warp per row);
 *   3. weights times values into register accumulators.
 * KVarN records (../shared/spec/KVARN.md "Attention over records"): the
 * query is rotated by H/sqrt(D) once; per tile a_d is folded into the query
 * and sum_d q_d b_d into one constant, so a token's score is a dot product
 * with its integer codes, times s_tok_t; values likewise take p_t a_t
 * against codes, plus s_chan_d * sum_t p_t b_t; the output is rotated back
 * once. fp16 pages (sink, staging tail) and per-token records are read row
 * by row. With num_splits > 1 each block writes (m, l, acc) to the
 * workspace and combine_kernel merges the splits. A learned sink
 * (kc_attn.sinks) enters once, in the final normalization (kc_out_scale).
 * Prefill chunks over KVarN tiles (kc_attn.matrix: a sequence's 32 or
 * more queries) take attn_mma.cu's tensor-core kernel instead, launched
 * first; its split-K partials are merged here too.
 */
#include <limits.h>

#include "cuda/common.cuh"
#include "cuda/kinds.cuh"

namespace {

constexpr int NT = KVARN_CUDA_ATTN_THREADS;
constexpr int NW = NT / 32;
constexpr int ROWS = KVARN_CUDA_ROWS;

template <int D, int GMAX>
struct attn_smem {
    float q[ROWS][D]; /* query rows (scaled, rotated); later the reduced output */
    union {
        struct {
            float qa[ROWS][D];          /* KVarN: q_d * a_d of the current tile */
            float red[NW][ROWS][GMAX];  /* KVarN: per-warp partial scores */
        } s;
        float ored[NW][ROWS][D];        /* epilogue: per-warp partial outputs */
    } u;
    float p[ROWS][GMAX]; /* scores, then softmax weights (KVarN: times a_t) */
    float m[ROWS], l[ROWS], alpha[ROWS], qb[ROWS], pb[ROWS];
    int klo[ROWS], khi[ROWS];
};

/* 8 fp16 values, 16-byte aligned. */
__device__ __forceinline__ void load_half8(const uint16_t *p, float (&w)[8])
{
    const uint4 u = *reinterpret_cast<const uint4 *>(p);
    const uint32_t v[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int e = 0; e < 4; e++) {
        w[2 * e] = kc_h2f((uint16_t)(v[e] & 0xffffu));
        w[2 * e + 1] = kc_h2f((uint16_t)(v[e] >> 16));
    }
}

/* Where the rows of one tile live: an fp16 page (K and V [G][D]) or the
 * token records of a per-token block. */
struct row_tile {
    const uint16_t *pk, *pv;  /* fp16 page, or NULL */
    const uint8_t *blk;       /* per-token block of this KV head */
    size_t trb;
};

template <int D, int KIND>
__device__ __forceinline__ void load_row8(const row_tile &rt, const kc_geom &g, bool is_k,
                                          int t, int c8, float (&w)[8])
{
    if (rt.pk != nullptr) {
        load_half8((is_k ? rt.pk : rt.pv) + (size_t)t * D + c8 * 8, w);
        return;
    }
    if constexpr (KIND != KVARN_KIND_KVARN) {
        const uint8_t *rec = rt.blk + (size_t)t * rt.trb;
        if (is_k) kc_kind<KIND>::load8(rec, g.k_codes_off, g.k_a_off, g.k_b_off, c8, w);
        else kc_kind<KIND>::load8(rec, g.v_codes_off, g.v_a_off, g.v_b_off, c8, w);
    }
}

__device__ __forceinline__ bool row_sees(const int *klo, const int *khi, int r, int pos)
{
    return pos >= klo[r] && pos < khi[r];
}

/* Phase 1, rows: scores of tokens [tlo, thi) of one tile read row by row. */
template <int D, int KIND, int GMAX>
__device__ void score_rows(attn_smem<D, GMAX> &sm, const row_tile &rt, const kc_geom &g,
                           int tok0, int tlo, int thi)
{
    /* lanes per token: one 8-channel group each, at most a warp (the sum
     * below is a warp shuffle); D = 512: two groups a lane, 32 apart */
    constexpr int CPT = D / 8 < 32 ? D / 8 : 32;
    constexpr int NC = D / 8 / CPT; /* 8-channel groups per lane */
    constexpr int TPB = NT / CPT;   /* tokens per pass */
    const int c8 = threadIdx.x % CPT, tsub = threadIdx.x / CPT;
    for (int base = tlo; base < thi; base += TPB) {
        const int t = base + tsub;
        const bool valid = t < thi;
        float acc[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; r++) acc[r] = 0.0f;
#pragma unroll
        for (int j = 0; j < NC; j++) {
            const int c = c8 + j * CPT;
            float w[8];
            if (valid) load_row8<D, KIND>(rt, g, true, t, c, w);
            else {
#pragma unroll
                for (int e = 0; e < 8; e++) w[e] = 0.0f;
            }
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                const float4 qa = *reinterpret_cast<const float4 *>(&sm.q[r][c * 8]);
                const float4 qb = *reinterpret_cast<const float4 *>(&sm.q[r][c * 8 + 4]);
                acc[r] += qa.x * w[0] + qa.y * w[1] + qa.z * w[2] + qa.w * w[3] +
                          qb.x * w[4] + qb.y * w[5] + qb.z * w[6] + qb.w * w[7];
            }
        }
#pragma unroll
        for (int o = CPT / 2; o > 0; o >>= 1)
#pragma unroll
            for (int r = 0; r < ROWS; r++) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
        if (valid && c8 == 0)
#pragma unroll
            for (int r = 0; r < ROWS; r++)
                sm.p[r][t] = row_sees(sm.klo, sm.khi, r, tok0 + t) ? acc[r] : -INFINITY;
    }
}

/* Phase 1, KVarN record: s = s_tok_t * (sum_d (q_d a_d) code[d,t] + sum_d q_d b_d).
 * Thread (tg, slice) takes 8 tokens [tg*8, tg*8+8) and D/NS channels. */
template <int D, int G, int KB>
__device__ void score_record(attn_smem<D, G> &sm, const uint8_t *rec, const kc_geom &g,
                             int tok0, int tlo, int thi, bool upper)
{
    constexpr int TGC = G / 8, NS = NT / TGC, DPS = D / NS;
    static_assert(TGC <= 32 && NS * DPS == D, "tile geometry");
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const uint8_t *ka = rec + g.k_a_off, *kb = rec + g.k_b_off;

    for (int k = tid; k < ROWS * D; k += NT) {
        const int r = k / D, d = k % D;
        sm.u.s.qa[r][d] = sm.q[r][d] * kc_h2f(kc_ld16(ka + 2 * d));
    }
    for (int r = warp; r < ROWS; r += NW) {
        float s = 0.0f;
        for (int d = lane; d < D; d += 32) s += sm.q[r][d] * kc_h2f(kc_ld16(kb + 2 * d));
        s = kc_warp_sum(s);
        if (lane == 0) sm.qb[r] = s;
    }
    __syncthreads();

    const int tg = tid % TGC, slice = tid / TGC;
    const uint8_t *codes = rec + g.k_codes_off + tg * KB;
    float acc[ROWS][8];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int e = 0; e < 8; e++) acc[r][e] = 0.0f;
#pragma unroll 4
    for (int dd = 0; dd < DPS; dd++) {
        const int d = slice * DPS + dd;
        float c[8];
        kc_load_codes8<KB>(codes + (size_t)d * (G * KB / 8), c);
#pragma unroll
        for (int r = 0; r < ROWS / 2; r++) {
            const float qa = sm.u.s.qa[r][d];
#pragma unroll
            for (int e = 0; e < 8; e++) acc[r][e] = fmaf(qa, c[e], acc[r][e]);
        }
        if (upper)
#pragma unroll
            for (int r = ROWS / 2; r < ROWS; r++) {
                const float qa = sm.u.s.qa[r][d];
#pragma unroll
                for (int e = 0; e < 8; e++) acc[r][e] = fmaf(qa, c[e], acc[r][e]);
            }
    }
#pragma unroll
    for (int o = TGC; o < 32; o <<= 1)
#pragma unroll
        for (int r = 0; r < ROWS; r++)
#pragma unroll
            for (int e = 0; e < 8; e++) acc[r][e] += __shfl_xor_sync(0xffffffffu, acc[r][e], o);
    if (lane < TGC)
#pragma unroll
        for (int r = 0; r < ROWS; r++)
#pragma unroll
            for (int e = 0; e < 8; e++) sm.u.s.red[warp][r][tg * 8 + e] = acc[r][e];
    __syncthreads();
    const uint8_t *stok = rec + g.k_stok_off;
    for (int k = tid; k < ROWS * G; k += NT) {
        const int r = k / G, t = k % G;
        if (t < tlo || t >= thi) continue;
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < NW; w++) s += sm.u.s.red[w][r][t];
        s = kc_h2f(kc_ld16(stok + 2 * t)) * (s + sm.qb[r]);
        sm.p[r][t] = row_sees(sm.klo, sm.khi, r, tok0 + t) ? s : -INFINITY;
    }
}

/* Phase 2: online softmax over tokens [tlo, thi), one warp per row. For a
 * KVarN record, p is stored times a_t and pb[r] = sum_t p_t b_t. */
template <int D, int GMAX>
__device__ void softmax_step(attn_smem<D, GMAX> &sm, int tlo, int thi, const uint8_t *va,
                             const uint8_t *vb)
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int r = warp; r < ROWS; r += NW) {
        float mx = -INFINITY;
        for (int t = tlo + lane; t < thi; t += 32) mx = fmaxf(mx, sm.p[r][t]);
        mx = kc_warp_max(mx);
        const float m_old = sm.m[r], m_new = fmaxf(m_old, mx);
        float sum = 0.0f, pb = 0.0f, alpha = 1.0f;
        if (m_new == -INFINITY) {
            for (int t = tlo + lane; t < thi; t += 32) sm.p[r][t] = 0.0f;
        } else {
            alpha = exp2f(m_old - m_new);
            for (int t = tlo + lane; t < thi; t += 32) {
                const float p = exp2f(sm.p[r][t] - m_new);
                sum += p;
                if (va != nullptr) {
                    sm.p[r][t] = p * kc_h2f(kc_ld16(va + 2 * t));
                    pb += p * kc_h2f(kc_ld16(vb + 2 * t));
                } else {
                    sm.p[r][t] = p;
                }
            }
        }
        sum = kc_warp_sum(sum);
        pb = kc_warp_sum(pb);
        if (lane == 0) {
            sm.m[r] = m_new;
            sm.l[r] = sm.l[r] * alpha + sum;
            sm.alpha[r] = alpha;
            sm.pb[r] = pb;
        }
    }
}

/* Phase 3, KVarN record: o[d] += s_chan_d * (sum_t (p_t a_t) code[t,d] +
 * sum_t p_t b_t). Thread (cg, ts) owns channels [cg*8, cg*8+8) and tokens
 * t = tlo + ts (mod TS). */
template <int D, int GMAX, int VB>
__device__ __forceinline__ void value_record(const attn_smem<D, GMAX> &sm, const uint8_t *rec,
                                             const kc_geom &g, int tlo, int thi, bool upper,
                                             float (&oacc)[ROWS][8])
{
    constexpr int CG = D / 8, TS = NT / CG;
    const int cg = threadIdx.x % CG, ts = threadIdx.x / CG;
    float sch[8];
    const uint8_t *vs = rec + g.v_schan_off + cg * 16;
#pragma unroll
    for (int e = 0; e < 8; e++) sch[e] = kc_h2f(kc_ld16(vs + 2 * e));
    const uint8_t *vc = rec + g.v_codes_off + cg * VB;
    for (int t = tlo + ts; t < thi; t += TS) {
        float w[8];
        kc_load_codes8<VB>(vc + (size_t)t * (D * VB / 8), w);
#pragma unroll
        for (int e = 0; e < 8; e++) w[e] *= sch[e];
#pragma unroll
        for (int r = 0; r < ROWS / 2; r++) {
            const float p = sm.p[r][t];
#pragma unroll
            for (int e = 0; e < 8; e++) oacc[r][e] = fmaf(p, w[e], oacc[r][e]);
        }
        if (upper)
#pragma unroll
            for (int r = ROWS / 2; r < ROWS; r++) {
                const float p = sm.p[r][t];
#pragma unroll
                for (int e = 0; e < 8; e++) oacc[r][e] = fmaf(p, w[e], oacc[r][e]);
            }
    }
    if (ts == 0)
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            const float pb = sm.pb[r];
#pragma unroll
            for (int e = 0; e < 8; e++) oacc[r][e] = fmaf(sch[e], pb, oacc[r][e]);
        }
}

/* Phase 3, rows: o[d] += sum_t p_t V[t,d]. */
template <int D, int KIND, int GMAX>
__device__ __forceinline__ void value_rows(const attn_smem<D, GMAX> &sm, const row_tile &rt,
                                           const kc_geom &g, int tlo, int thi, bool upper,
                                           float (&oacc)[ROWS][8])
{
    constexpr int CG = D / 8, TS = NT / CG;
    const int cg = threadIdx.x % CG, ts = threadIdx.x / CG;
    for (int t = tlo + ts; t < thi; t += TS) {
        float w[8];
        load_row8<D, KIND>(rt, g, false, t, cg, w);
#pragma unroll
        for (int r = 0; r < ROWS / 2; r++) {
            const float p = sm.p[r][t];
#pragma unroll
            for (int e = 0; e < 8; e++) oacc[r][e] = fmaf(p, w[e], oacc[r][e]);
        }
        if (upper)
#pragma unroll
            for (int r = ROWS / 2; r < ROWS; r++) {
                const float p = sm.p[r][t];
#pragma unroll
                for (int e = 0; e < 8; e++) oacc[r][e] = fmaf(p, w[e], oacc[r][e]);
            }
    }
}

template <int D, int KIND, int G_T, int KB, int VB>
__global__ void __launch_bounds__(NT) attn_kernel(kc_attn a)
{
    constexpr bool KVARN = KIND == KVARN_KIND_KVARN;
    constexpr int GMAX = KVARN ? G_T : KVARN_CUDA_MAX_BLOCK;
    constexpr int E = D / 32;
    constexpr int CG = D / 8; /* value phase: channel groups of 8 */
    /* dynamic: past the 48 KiB of static shared memory at D = 512 */
    KC_DYNAMIC_SMEM(uint4, smem_u4);
    attn_smem<D, GMAX> &sm = *reinterpret_cast<attn_smem<D, GMAX> *>(smem_u4);

    const int G = KVARN ? G_T : a.g.G;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int hk = blockIdx.x / a.row_chunks, chunk = blockIdx.x % a.row_chunks;
    const int seq = blockIdx.y, split = blockIdx.z;
    const int seq_len = a.seq_lens[seq];
    int nq = 1, q0 = seq;
    if (a.query_start_loc != nullptr) {
        q0 = a.query_start_loc[seq];
        nq = a.query_start_loc[seq + 1] - q0;
    }
    const int gs = a.group_size, row0 = chunk * ROWS;
    const int nr = min(ROWS, nq * gs - row0);
    if (nr <= 0 || (a.matrix && nq >= KVARN_CUDA_MMA_MIN_QUERIES)) return; /* attn_mma.cu's */

    if (tid < ROWS) {
        int lo = 0, hi = 0;
        if (tid < nr) kc_row_keys(a, seq_len, nq, row0 + tid, &lo, &hi);
        sm.klo[tid] = lo;
        sm.khi[tid] = hi;
        sm.m[tid] = -INFINITY;
        sm.l[tid] = 0.0f;
    }
    for (int r = warp; r < ROWS; r += NW) {
        float x[E];
        if (r < nr) {
            kc_load_query<D>(a, q0, hk, row0 + r, KVARN, x);
        } else {
#pragma unroll
            for (int e = 0; e < E; e++) x[e] = 0.0f;
        }
#pragma unroll
        for (int e = 0; e < E; e++) sm.q[r][lane * E + e] = x[e];
    }
    __syncthreads();

    int ulo = INT_MAX, uhi = 0;
    for (int r = 0; r < ROWS; r++)
        if (sm.khi[r] > sm.klo[r]) {
            ulo = min(ulo, sm.klo[r]);
            uhi = max(uhi, sm.khi[r]);
        }

    const int cg = tid % CG;
    const bool upper = nr > ROWS / 2; /* rows 4..7 in use: skip their FMAs if not */
    float oacc[ROWS][8];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int e = 0; e < 8; e++) oacc[r][e] = 0.0f;

    if (uhi > ulo) {
        int my_b, my_e;
        kc_split_tiles(a, ulo, uhi, G, split, &my_b, &my_e);
        const int32_t *bt = a.block_tables + (size_t)seq * a.max_blocks;
        const int committed = KVARN ? a.committed_tiles[seq] : 0;
        for (int i = my_b; i < my_e; i++) {
            const int bid = bt[i];
            const int tok0 = i * G;
            const int tlo = max(ulo - tok0, 0), thi = min(uhi - tok0, G);
            const bool page = KVARN && kvarn_paged_tile_is_page(&a.g.kv, committed, i);
            if (bid < 0 || bid >= (page ? a.g.kv.n_fp16_pages : a.g.kv.n_blocks)) continue;
            row_tile rt = {nullptr, nullptr, nullptr, a.g.kv.token_record_bytes};
            const uint8_t *rec = page ? nullptr : kvarn_paged_record(&a.g.kv, bid, hk);
            if (page) {
                rt.pk = kvarn_paged_page_k(&a.g.kv, bid, hk);
                rt.pv = kvarn_paged_page_v(&a.g.kv, bid, hk);
            } else {
                rt.blk = rec;
            }

            /* 1. scores */
            if constexpr (KVARN) {
                if (!page) score_record<D, G_T, KB>(sm, rec, a.g, tok0, tlo, thi, upper);
                else score_rows<D, KIND, GMAX>(sm, rt, a.g, tok0, tlo, thi);
            } else {
                score_rows<D, KIND, GMAX>(sm, rt, a.g, tok0, tlo, thi);
            }
            __syncthreads();

            /* 2. softmax */
            const bool qrec = KVARN && !page;
            softmax_step<D, GMAX>(sm, tlo, thi, qrec ? rec + a.g.v_a_off : nullptr,
                                  qrec ? rec + a.g.v_b_off : nullptr);
            __syncthreads();

            /* 3. values */
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                const float al = sm.alpha[r];
#pragma unroll
                for (int e = 0; e < 8; e++) oacc[r][e] *= al;
            }
            if constexpr (KVARN) {
                if (qrec) value_record<D, GMAX, VB>(sm, rec, a.g, tlo, thi, upper, oacc);
                else value_rows<D, KIND, GMAX>(sm, rt, a.g, tlo, thi, upper, oacc);
            } else {
                value_rows<D, KIND, GMAX>(sm, rt, a.g, tlo, thi, upper, oacc);
            }
            __syncthreads();
        }
    }

    /* Epilogue: reduce the token slices, then write out or the partial. */
#pragma unroll
    for (int o = CG; o < 32; o <<= 1)
#pragma unroll
        for (int r = 0; r < ROWS; r++)
#pragma unroll
            for (int e = 0; e < 8; e++) oacc[r][e] += __shfl_xor_sync(0xffffffffu, oacc[r][e], o);
    if (lane < CG)
#pragma unroll
        for (int r = 0; r < ROWS; r++)
#pragma unroll
            for (int e = 0; e < 8; e++) sm.u.ored[warp][r][cg * 8 + e] = oacc[r][e];
    __syncthreads();
    for (int k = tid; k < ROWS * D; k += NT) {
        const int r = k / D, d = k % D;
        float s = 0.0f;
        /* CG > 32 (D = 512): warp w wrote channel groups [32 (w mod
         * WPG), + 32) only, WPG = CG / 32 warps covering the channels */
        constexpr int WPG = CG > 32 ? CG / 32 : 1;
#pragma unroll
        for (int w = 0; w < NW; w++)
            if (w % WPG == d / 8 / 32 % WPG) s += sm.u.ored[w][r][d];
        sm.q[r][d] = s;
    }
    __syncthreads();

    if (a.num_splits == 1) {
        for (int r = warp; r < nr; r += NW) {
            const int rr = row0 + r;
            const float inv = kc_out_scale(a.sinks, hk * gs + rr % gs, sm.m[r], sm.l[r]);
            float x[E];
#pragma unroll
            for (int e = 0; e < E; e++) x[e] = sm.q[r][lane * E + e] * inv;
            kc_store_out<D>(a, q0, hk, rr, KVARN, x);
        }
    } else {
        const size_t entry = ((size_t)seq * gridDim.x + blockIdx.x) * a.num_splits + split;
        float *ws = a.ws + entry * kc_partial_floats(D);
        if (tid < ROWS) {
            ws[tid] = sm.m[tid];
            ws[ROWS + tid] = sm.l[tid];
        }
        for (int k = tid; k < ROWS * D; k += NT) ws[2 * ROWS + k] = sm.q[k / D][k % D];
    }
}

/* Merge the split-K partials of one (sequence, KV head, row chunk); one warp
 * per row: M = max m_s, out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,
 * rotated back for KVarN; a learned sink joins the sum (kc_out_scale). */
template <int D, bool ROT>
__global__ void __launch_bounds__(32 * ROWS) combine_kernel(kc_attn a)
{
    constexpr int E = D / 32;
    const int r = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int hk = blockIdx.x / a.row_chunks, chunk = blockIdx.x % a.row_chunks;
    const int seq = blockIdx.y;
    int nq = 1, q0 = seq;
    if (a.query_start_loc != nullptr) {
        q0 = a.query_start_loc[seq];
        nq = a.query_start_loc[seq + 1] - q0;
    }
    const int gs = a.group_size, rr = chunk * ROWS + r;
    if (rr >= nq * gs) return;
    const size_t pf = kc_partial_floats(D);
    const float *base = a.ws + ((size_t)seq * gridDim.x + blockIdx.x) * a.num_splits * pf;
    float M = -INFINITY;
    for (int s = 0; s < a.num_splits; s++) M = fmaxf(M, base[s * pf + r]);
    float x[E], L = 0.0f;
#pragma unroll
    for (int e = 0; e < E; e++) x[e] = 0.0f;
    if (M != -INFINITY) {
        for (int s = 0; s < a.num_splits; s++) {
            const float *p = base + s * pf;
            const float w = exp2f(p[r] - M);
            L += w * p[ROWS + r];
#pragma unroll
            for (int e = 0; e < E; e++) x[e] += w * p[2 * ROWS + r * D + lane * E + e];
        }
    }
    const float inv = kc_out_scale(a.sinks, hk * gs + rr % gs, M, L);
#pragma unroll
    for (int e = 0; e < E; e++) x[e] *= inv;
    kc_store_out<D>(a, q0, hk, rr, ROT, x);
}

template <int D, int KIND, int G, int KB, int VB>
cudaError_t launch_attn(const kc_attn &a, int num_seqs, cudaStream_t s)
{
    const dim3 grid((unsigned)(a.g.Hk * a.row_chunks), (unsigned)num_seqs, (unsigned)a.num_splits);
    auto kernel = attn_kernel<D, KIND, G, KB, VB>;
    constexpr int GMAX = KIND == KVARN_KIND_KVARN ? G : KVARN_CUDA_MAX_BLOCK;
    const size_t smem = sizeof(attn_smem<D, GMAX>);
    if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute((const void *)kernel,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
    }
    KC_LAUNCH(kernel, grid, NT, smem, s, a);
    return cudaGetLastError();
}

/* The split-K merge of either kernel's partials: one block per (sequence,
 * KV head, 8-row chunk). */
template <int D, bool ROT>
cudaError_t launch_combine(const kc_attn &a, int num_seqs, cudaStream_t s)
{
    auto combine = combine_kernel<D, ROT>;
    KC_LAUNCH(combine, dim3((unsigned)(a.g.Hk * a.row_chunks), (unsigned)num_seqs), 32 * ROWS, 0,
              s, a);
    return cudaGetLastError();
}

cudaError_t launch_main(const kc_attn &a, int num_seqs, cudaStream_t s)
{
    const kc_geom &g = a.g;
    if (a.matrix) {
        /* the long sequences on the tensor cores, then the rest here */
        cudaError_t e = kc_launch_attn_mma(a, num_seqs, s);
        if (e != cudaSuccess) return e;
    }
    if (g.kind == KVARN_KIND_KVARN) {
#define KC_ATTN_KVARN(D_, G_, KB_, VB_)                                           \
    if (g.D == D_ && g.G == G_ && g.key_bits == KB_ && g.value_bits == VB_)      \
        return launch_attn<D_, KVARN_KIND_KVARN, G_, KB_, VB_>(a, num_seqs, s);
#define KC_ATTN_KVARN_D(D_) KVARN_CUDA_KVARN_PRESETS(KC_ATTN_KVARN, D_)
        KVARN_CUDA_HEAD_DIMS(KC_ATTN_KVARN_D)
#undef KC_ATTN_KVARN_D
#undef KC_ATTN_KVARN
        return cudaErrorInvalidValue;
    }
#define KC_ATTN_TOKEN(D_, KIND_) \
    if (g.D == D_ && g.kind == KIND_) return launch_attn<D_, KIND_, 0, 0, 0>(a, num_seqs, s);
#define KC_ATTN_TOKEN_D(D_) KVARN_CUDA_TOKEN_KINDS(KC_ATTN_TOKEN, D_)
    KVARN_CUDA_HEAD_DIMS(KC_ATTN_TOKEN_D)
#undef KC_ATTN_TOKEN_D
#undef KC_ATTN_TOKEN
    return cudaErrorInvalidValue;
}

} // namespace

cudaError_t kc_launch_attn(const kc_attn &a, int num_seqs, cudaStream_t s)
{
    cudaError_t e = launch_main(a, num_seqs, s);
    if (e != cudaSuccess || a.num_splits == 1) return e;
    const bool rot = a.g.kind == KVARN_KIND_KVARN;
#define KC_COMBINE(D_)                                                       \
    if (a.g.D == D_)                                                         \
        return rot ? launch_combine<D_, true>(a, num_seqs, s)                \
                   : launch_combine<D_, false>(a, num_seqs, s);
    KVARN_CUDA_HEAD_DIMS(KC_COMBINE)
#undef KC_COMBINE
    return cudaErrorInvalidValue;
}
