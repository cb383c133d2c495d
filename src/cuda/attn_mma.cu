/*
 * attn_mma.cu -- multi-query attention (chunked prefill) over KVarN tiles
 * on the tensor cores: per tile, one matrix product for the scores and one
 * for the weighted values (issue 44: "for each (block of query rows, tile),
 * unpack the tile's codes once, into a form the matrix instructions take").
 *
 * Work split: one thread block of 4 warps per (sequence, KV head, block of
 * 64 query rows, split); a row is one query head of the GQA group for one
 * query, as in attn.cu, and warp w owns rows [16 w, 16 w + 16). Per tile of
 * G tokens:
 *   1. the tile's keys and values are dequantized once into shared memory
 *      as bf16: a record's k_td = s_tok_t (a_d c_td + b_d) and v_td =
 *      s_chan_d (a_t c_td + b_t), each formed in fp32 (one FMA, then the
 *      product) and rounded to bf16 (nearest even); an fp16 page's (sink,
 *      staged tail) K and V rounded from fp16 to bf16. Tokens outside the
 *      rows' union of visible positions are zeros;
 *   2. scores S = bf16(q') . K^T on mma.sync m16n8k16 (bf16 in, fp32
 *      sums), q' the rotated query with softmax_scale * log2(e) folded in,
 *      rounded to bf16 once per thread block;
 *   3. the online softmax in registers (base 2; the four lanes that hold a
 *      row reduce its maximum by shuffles), each weight p_t = 2^(s_t - m)
 *      rounded to bf16 for the value product, the row sums l in fp32 of the
 *      unrounded p_t;
 *   4. O += bf16(p) . V on the same instruction, O in fp32 registers.
 * The output is rotated back once (epilogue, as attn.cu), or written as
 * split-K partials in attn.cu's layout (8-row entries), which attn.cu's
 * combine kernel merges. It takes the sequences of the call with at least
 * KVARN_CUDA_MMA_MIN_QUERIES queries; attn.cu's kernel, launched after it,
 * the others.
 *
 * Rounding (include/kvarn/cuda.h kvarn_cuda_attn_kernel_info,
 * KVARN_ATTN_ARITH_BF16): q', every key, value and weight rounded once to
 * bf16 (relative error at most 2^-8 each), products exact, sums in fp32;
 * what vLLM's bf16 cache rounds, and the CPU's AMX kernel's statement
 * (docs/attention-matrix.md).
 *
 * Served: KVarN formats at D in {64, 128} (dispatch.h
 * KVARN_CUDA_MMA_HEAD_DIMS), compute capability 8.0 or later (bf16 mma).
 * The fragment layouts are those of the PTX ISA for
 * mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32; tests/cuda/emu
 * emulates that one instruction (kc_emu_mma_bf16).
 */
#include <limits.h>

#include "cuda/common.cuh"

namespace {

constexpr int NT = KVARN_CUDA_ATTN_THREADS;
constexpr int MR = KVARN_CUDA_MMA_ROWS;
static_assert(MR == 16 * (NT / 32), "one 16-row slab per warp");

/* bf16 rows padded by 8 elements (16 bytes): a row's stride is then 4 banks
 * past a multiple of 32, so the 32 lanes of a fragment load (8 rows x 4
 * pairs) hit 32 different banks. */
template <int D, int G>
struct mma_smem {
    uint16_t q[MR][D + 8];        /* bf16(q'), rows of the thread block */
    union {
        struct {
            uint16_t k[G][D + 8]; /* bf16 keys, token-major (B of the scores) */
            uint16_t v[D][G + 8]; /* bf16 values, channel-major (B of the sums) */
        } t;
        float out[MR][D + 4];     /* epilogue: unnormalized outputs (padded:
                                     the fragment stores hit 2 banks, not 8) */
    } u;
    float m[MR], l[MR];
    int klo[MR], khi[MR];
};

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    return (uint32_t)kc_f2bf(lo) | ((uint32_t)kc_f2bf(hi) << 16);
}

__device__ __forceinline__ uint32_t ld_pair(const uint16_t *p)
{
    return *reinterpret_cast<const uint32_t *>(p);
}

/* Step 1: the tile's K and V into shared memory as bf16. rec: the record,
 * or NULL for an fp16 page (pk, pv). Tokens outside [tlo, thi) are zeros,
 * so that neither product reads a token nobody may see (a page's unwritten
 * rows may hold anything). */
template <int D, int G, int KB, int VB>
__device__ void load_tile(mma_smem<D, G> &sm, const kc_geom &g, const uint8_t *rec,
                          const uint16_t *pk, const uint16_t *pv, int tlo, int thi)
{
    const int tid = threadIdx.x;
    if (rec != nullptr) {
        /* K: codes channel-major, G per channel; thread (d, 8 tokens) */
        const uint8_t *ka = rec + g.k_a_off, *kb = rec + g.k_b_off, *st = rec + g.k_stok_off;
        for (int i = tid; i < D * (G / 8); i += NT) {
            const int d = i % D, tg = i / D;
            float c[8];
            kc_load_codes8<KB>(rec + g.k_codes_off + (size_t)d * (G * KB / 8) + tg * KB, c);
            const float a = kc_h2f(kc_ld16(ka + 2 * d)), b = kc_h2f(kc_ld16(kb + 2 * d));
#pragma unroll
            for (int e = 0; e < 8; e++) {
                const int t = tg * 8 + e;
                const float x = fmaf(a, c[e], b) * kc_h2f(kc_ld16(st + 2 * t));
                sm.u.t.k[t][d] = t >= tlo && t < thi ? kc_f2bf(x) : (uint16_t)0;
            }
        }
        /* V: codes token-major, D per token; thread (token, 8 channels) */
        const uint8_t *va = rec + g.v_a_off, *vb = rec + g.v_b_off, *vs = rec + g.v_schan_off;
        for (int i = tid; i < G * (D / 8); i += NT) {
            const int t = i % G, cg = i / G;
            float c[8];
            kc_load_codes8<VB>(rec + g.v_codes_off + (size_t)t * (D * VB / 8) + cg * VB, c);
            const float a = kc_h2f(kc_ld16(va + 2 * t)), b = kc_h2f(kc_ld16(vb + 2 * t));
            const bool in = t >= tlo && t < thi;
#pragma unroll
            for (int e = 0; e < 8; e++) {
                const int d = cg * 8 + e;
                const float x = fmaf(a, c[e], b) * kc_h2f(kc_ld16(vs + 2 * d));
                sm.u.t.v[d][t] = in ? kc_f2bf(x) : (uint16_t)0;
            }
        }
        return;
    }
    /* fp16 page: K and V [G][D], token-major */
    for (int i = tid; i < G * D; i += NT) {
        const int t = i / D, d = i % D;
        const bool in = t >= tlo && t < thi;
        sm.u.t.k[t][d] = in ? kc_f2bf(kc_h2f(pk[(size_t)t * D + d])) : (uint16_t)0;
    }
    for (int i = tid; i < G * D; i += NT) {
        const int d = i / G, t = i % G;
        const bool in = t >= tlo && t < thi;
        sm.u.t.v[d][t] = in ? kc_f2bf(kc_h2f(pv[(size_t)t * D + d])) : (uint16_t)0;
    }
}

template <int D, int G, int KB, int VB>
__global__ void __launch_bounds__(NT) attn_mma_kernel(kc_attn a)
{
    constexpr int E = D / 32;
    constexpr int KQ = D / 16; /* k-steps of the score product */
    constexpr int NS = G / 8;  /* 8-token column blocks of the scores */
    constexpr int NO = D / 8;  /* 8-channel column blocks of the output */
    KC_DYNAMIC_SMEM(uint4, smem_u4);
    mma_smem<D, G> &sm = *reinterpret_cast<mma_smem<D, G> *>(smem_u4);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int gid = lane >> 2, tig = lane & 3; /* fragment row group, pair */
    const int mchunks = (a.row_chunks + MR / KVARN_CUDA_ROWS - 1) / (MR / KVARN_CUDA_ROWS);
    const int hk = blockIdx.x / mchunks, mc = blockIdx.x % mchunks;
    const int seq = blockIdx.y, split = blockIdx.z;
    const int seq_len = a.seq_lens[seq];
    const int q0 = a.query_start_loc[seq], nq = a.query_start_loc[seq + 1] - q0;
    const int gs = a.group_size, row0 = mc * MR;
    const int nr = min(MR, nq * gs - row0);
    /* sequences with fewer queries are the vector kernel's (attn.cu), so
     * that a sequence's output does not depend on the rest of the batch */
    if (nr <= 0 || nq < KVARN_CUDA_MMA_MIN_QUERIES) return;

    if (tid < MR) {
        int lo = 0, hi = 0;
        if (tid < nr) kc_row_keys(a, seq_len, nq, row0 + tid, &lo, &hi);
        sm.klo[tid] = lo;
        sm.khi[tid] = hi;
    }
    /* q' = H q / sqrt(D) * scale * log2(e), one warp per row, to bf16 */
    for (int r = warp; r < MR; r += NT / 32) {
        float x[E];
        if (r < nr) {
            kc_load_query<D>(a, q0, hk, row0 + r, true, x);
        } else {
#pragma unroll
            for (int e = 0; e < E; e++) x[e] = 0.0f;
        }
#pragma unroll
        for (int e = 0; e < E; e++) sm.q[r][lane * E + e] = kc_f2bf(x[e]);
    }
    __syncthreads();

    /* this lane's two rows (fragment rows gid and gid + 8 of its warp) */
    const int ra = warp * 16 + gid, rb = ra + 8;
    const int loa = sm.klo[ra], hia = sm.khi[ra], lob = sm.klo[rb], hib = sm.khi[rb];
    uint32_t qf[KQ][4];
#pragma unroll
    for (int kk = 0; kk < KQ; kk++) {
        const int c = kk * 16 + tig * 2;
        qf[kk][0] = ld_pair(&sm.q[ra][c]);
        qf[kk][1] = ld_pair(&sm.q[rb][c]);
        qf[kk][2] = ld_pair(&sm.q[ra][c + 8]);
        qf[kk][3] = ld_pair(&sm.q[rb][c + 8]);
    }
    int ulo = INT_MAX, uhi = 0;
    for (int r = 0; r < MR; r++)
        if (sm.khi[r] > sm.klo[r]) {
            ulo = min(ulo, sm.klo[r]);
            uhi = max(uhi, sm.khi[r]);
        }

    float ma = -INFINITY, mb = -INFINITY, la = 0.0f, lb = 0.0f; /* l: this lane's share */
    float o[NO][4];
#pragma unroll
    for (int j = 0; j < NO; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[j][e] = 0.0f;

    if (uhi > ulo) {
        int my_b, my_e;
        kc_split_tiles(a, ulo, uhi, G, split, &my_b, &my_e);
        const int32_t *bt = a.block_tables + (size_t)seq * a.max_blocks;
        const int committed = a.committed_tiles[seq];
        for (int i = my_b; i < my_e; i++) {
            const int bid = bt[i];
            const int tok0 = i * G;
            const int tlo = max(ulo - tok0, 0), thi = min(uhi - tok0, G);
            const bool page = kvarn_paged_tile_is_page(&a.g.kv, committed, i);
            /* the same test for every thread: skipped tiles keep the
             * barriers in step */
            if (bid < 0 || bid >= (page ? a.g.kv.n_fp16_pages : a.g.kv.n_blocks)) continue;
            __syncthreads(); /* the previous tile's K and V are no longer read */
            if (page)
                load_tile<D, G, KB, VB>(sm, a.g, nullptr, kvarn_paged_page_k(&a.g.kv, bid, hk),
                                        kvarn_paged_page_v(&a.g.kv, bid, hk), tlo, thi);
            else
                load_tile<D, G, KB, VB>(sm, a.g, kvarn_paged_record(&a.g.kv, bid, hk), nullptr,
                                        nullptr, tlo, thi);
            __syncthreads();
            if (warp * 16 >= nr) continue; /* no rows of this block: no barrier below */

            /* 2. scores: s[j] covers tokens 8 j + 2 tig + {0, 1}, rows ra (0, 1), rb (2, 3) */
            float s[NS][4];
#pragma unroll
            for (int j = 0; j < NS; j++) {
#pragma unroll
                for (int e = 0; e < 4; e++) s[j][e] = 0.0f;
                const uint16_t *krow = sm.u.t.k[j * 8 + gid];
#pragma unroll
                for (int kk = 0; kk < KQ; kk++) {
                    const uint32_t b[2] = {ld_pair(krow + kk * 16 + tig * 2),
                                           ld_pair(krow + kk * 16 + 8 + tig * 2)};
                    kc_mma_bf16(s[j], qf[kk], b);
                }
            }

            /* 3. online softmax; positions a row may not see are -inf */
            float xa = -INFINITY, xb = -INFINITY;
#pragma unroll
            for (int j = 0; j < NS; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int pos = tok0 + j * 8 + tig * 2 + e;
                    if (!(pos >= loa && pos < hia)) s[j][e] = -INFINITY;
                    if (!(pos >= lob && pos < hib)) s[j][2 + e] = -INFINITY;
                    xa = fmaxf(xa, s[j][e]);
                    xb = fmaxf(xb, s[j][2 + e]);
                }
#pragma unroll
            for (int off = 1; off < 4; off <<= 1) {
                xa = fmaxf(xa, __shfl_xor_sync(0xffffffffu, xa, off));
                xb = fmaxf(xb, __shfl_xor_sync(0xffffffffu, xb, off));
            }
            const float na = fmaxf(ma, xa), nb = fmaxf(mb, xb);
            const float aa = na == -INFINITY ? 1.0f : exp2f(ma - na);
            const float ab = nb == -INFINITY ? 1.0f : exp2f(mb - nb);
            ma = na;
            mb = nb;
            float sa = 0.0f, sb = 0.0f;
#pragma unroll
            for (int j = 0; j < NS; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float pa = s[j][e] == -INFINITY ? 0.0f : exp2f(s[j][e] - na);
                    const float pb = s[j][2 + e] == -INFINITY ? 0.0f : exp2f(s[j][2 + e] - nb);
                    s[j][e] = pa;
                    s[j][2 + e] = pb;
                    sa += pa;
                    sb += pb;
                }
            la = la * aa + sa;
            lb = lb * ab + sb;
#pragma unroll
            for (int j = 0; j < NO; j++) {
                o[j][0] *= aa;
                o[j][1] *= aa;
                o[j][2] *= ab;
                o[j][3] *= ab;
            }

            /* 4. O += bf16(p) . V: the scores' accumulator layout of two
             * 8-token blocks is the A layout of one 16-token k-step */
#pragma unroll
            for (int kc = 0; kc < G / 16; kc++) {
                const uint32_t pf[4] = {pack_bf16(s[2 * kc][0], s[2 * kc][1]),
                                        pack_bf16(s[2 * kc][2], s[2 * kc][3]),
                                        pack_bf16(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                                        pack_bf16(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
                for (int j = 0; j < NO; j++) {
                    const uint16_t *vrow = sm.u.t.v[j * 8 + gid];
                    const uint32_t b[2] = {ld_pair(vrow + kc * 16 + tig * 2),
                                           ld_pair(vrow + kc * 16 + 8 + tig * 2)};
                    kc_mma_bf16(o[j], pf, b);
                }
            }
        }
    }

    /* Epilogue: each row's l over its four lanes; O to shared memory */
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        la += __shfl_xor_sync(0xffffffffu, la, off);
        lb += __shfl_xor_sync(0xffffffffu, lb, off);
    }
    __syncthreads(); /* the last tile's K and V are no longer read */
#pragma unroll
    for (int j = 0; j < NO; j++) {
        const int c = j * 8 + tig * 2;
        sm.u.out[ra][c] = o[j][0];
        sm.u.out[ra][c + 1] = o[j][1];
        sm.u.out[rb][c] = o[j][2];
        sm.u.out[rb][c + 1] = o[j][3];
    }
    if (tig == 0) {
        sm.m[ra] = ma;
        sm.l[ra] = la;
        sm.m[rb] = mb;
        sm.l[rb] = lb;
    }
    __syncthreads();

    if (a.num_splits == 1) {
        for (int r = warp; r < nr; r += NT / 32) {
            const int rr = row0 + r;
            const float inv = kc_out_scale(a.sinks, hk * gs + rr % gs, sm.m[r], sm.l[r]);
            float x[E];
#pragma unroll
            for (int e = 0; e < E; e++) x[e] = sm.u.out[r][lane * E + e] * inv;
            kc_store_out<D>(a, q0, hk, rr, true, x);
        }
        return;
    }
    /* split-K partials, one entry per 8 rows as attn.cu writes them (its
     * grid.x is n_kv_heads * row_chunks) */
    constexpr int R8 = KVARN_CUDA_ROWS;
    const size_t pf = kc_partial_floats(D);
    for (int k = tid; k < MR * (D + 2); k += NT) {
        const int r = k / (D + 2), x = k % (D + 2);
        const int c8 = (row0 + r) / R8;
        if (c8 >= a.row_chunks) continue;
        const size_t entry =
            (((size_t)seq * a.g.Hk + hk) * a.row_chunks + c8) * a.num_splits + split;
        float *ws = a.ws + entry * pf;
        const int r8 = (row0 + r) % R8;
        if (x == 0) ws[r8] = sm.m[r];
        else if (x == 1) ws[R8 + r8] = sm.l[r];
        else ws[2 * R8 + r8 * D + (x - 2)] = sm.u.out[r][x - 2];
    }
}

template <int D, int G, int KB, int VB>
cudaError_t launch_mma(const kc_attn &a, int num_seqs, cudaStream_t s)
{
    const int mchunks = (a.row_chunks + MR / KVARN_CUDA_ROWS - 1) / (MR / KVARN_CUDA_ROWS);
    const dim3 grid((unsigned)(a.g.Hk * mchunks), (unsigned)num_seqs, (unsigned)a.num_splits);
    auto kernel = attn_mma_kernel<D, G, KB, VB>;
    const size_t smem = sizeof(mma_smem<D, G>);
    if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute((const void *)kernel,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
    }
    KC_LAUNCH(kernel, grid, NT, smem, s, a);
    return cudaGetLastError();
}

} // namespace

bool kc_attn_mma_compiled(void)
{
#ifdef KC_EMULATE
    return true;
#else
    /* the machine code (or PTX) this device runs must be for 8.0 or later:
     * below it kc_mma_bf16 traps (a build for older targets, JIT-compiled) */
    static int cached = -1;
    if (cached < 0) {
        cudaFuncAttributes fa;
        cached = cudaFuncGetAttributes(&fa, (const void *)attn_mma_kernel<64, 64, 4, 2>) ==
                         cudaSuccess &&
                 fa.binaryVersion >= 80 && fa.ptxVersion >= 80;
    }
    return cached == 1;
#endif
}

cudaError_t kc_launch_attn_mma(const kc_attn &a, int num_seqs, cudaStream_t s)
{
    const kc_geom &g = a.g;
    if (g.kind != KVARN_KIND_KVARN) return cudaErrorInvalidValue;
#define KC_MMA_KVARN(D_, G_, KB_, VB_)                                       \
    if (g.D == D_ && g.G == G_ && g.key_bits == KB_ && g.value_bits == VB_) \
        return launch_mma<D_, G_, KB_, VB_>(a, num_seqs, s);
#define KC_MMA_KVARN_D(D_) KVARN_CUDA_KVARN_PRESETS(KC_MMA_KVARN, D_)
    KVARN_CUDA_MMA_HEAD_DIMS(KC_MMA_KVARN_D)
#undef KC_MMA_KVARN_D
#undef KC_MMA_KVARN
    return cudaErrorInvalidValue;
}
