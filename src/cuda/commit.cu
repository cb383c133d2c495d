/*
 * commit.cu -- the KVarN commit kernel: one full, accepted fp16 page (already
 * rotated) of one KV head becomes one record.
 * ../shared/spec/KVARN.md "Store pipeline" steps 2-5, in the same order and
 * the same fp32 arithmetic as the CPU encoder (kvarn_encode, prerotated):
 *   variance normalization (column pass, row pass, imbalance
 *   score, best scales kept, ties to the later iteration), asymmetric RTN
 *   per row of the balanced tile, folding of the RTN scale and minimum into
 *   the row's balance scale, packing low bits first.
 * Layout of the matrices (spec step 2): K is D rows (channels) x G columns
 * (tokens), V is G rows (tokens) x D columns (channels); the page holds both
 * token-major, so element (i, j) sits at x[i * row_step + j * col_step].
 * One thread block of 256 threads per (tile, KV head); the tile is held in
 * shared memory as fp16 (the page's own precision, nothing lost).
 */
#include "cuda/common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

struct matrix {
    const __half *x;
    int rows, cols, row_step, col_step;
};

/* Spec step 2 constants, in the multiplicative form the CPU encoder uses
 * (src/codec/kvarn_tile.c): c += log(std), clip c to [-0.3, 10] is carried
 * out as s *= std, clip s to [exp(-0.3), exp(10)]. */
#define STD_MIN 1e-3f
#define STD_MAX 1e3f
#define SCALE_MIN 0.74081822068171788f /* exp(-0.3) */
#define SCALE_MAX 22026.465794806718f  /* exp(10) */
#define SCORE_STD_FLOOR 1e-8f
#define SCORE_TIE_RTOL 1e-5 /* relative distance at which two scores tie */
#define RTN_SCALE_MIN 1e-10f

/* Unbiased std (N-1) of one line of y = x * f, by one warp: is_col, the
 * column `line` over rows with f = w[i]; else the row `line` over columns
 * with f = u[j]. Two passes (mean, then squared deviations) on data shifted
 * by the line's first element, as the CPU encoder does, so that a constant
 * line gives exactly 0. */
__device__ float line_std(const matrix &m, int line, bool is_col, const float *f)
{
    const int lane = threadIdx.x & 31;
    const int n = is_col ? m.rows : m.cols;
    const int base = is_col ? line * m.col_step : line * m.row_step;
    const int step = is_col ? m.row_step : m.col_step;
    const float shift = __half2float(m.x[base]) * f[0];
    float sum = 0.0f;
    for (int k = lane; k < n; k += 32) sum += __half2float(m.x[base + k * step]) * f[k] - shift;
    const float mean = kc_warp_sum(sum) * (1.0f / (float)n); /* n a power of two: exact */
    float ss = 0.0f;
    for (int k = lane; k < n; k += 32) {
        const float d = __half2float(m.x[base + k * step]) * f[k] - shift - mean;
        ss += d * d;
    }
    return sqrtf(kc_warp_sum(ss) / (float)(n - 1));
}

/* out[l] = std of line l of x * f, times post[l] when post is not NULL. */
__device__ void all_stds(const matrix &m, bool is_col, const float *f, const float *post,
                         float *out)
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = is_col ? m.cols : m.rows;
    for (int l = warp; l < n; l += kWarps) {
        float s = line_std(m, l, is_col, f);
        if (post != nullptr) s *= post[l];
        if (lane == 0) out[l] = s;
    }
}

/* max/min of n stds with the min floored at 1e-8, in double; by one warp. */
__device__ double std_ratio(const float *sd, int n)
{
    const int lane = threadIdx.x & 31;
    float mx = -INFINITY, mn = INFINITY;
    for (int k = lane; k < n; k += 32) {
        mx = fmaxf(mx, sd[k]);
        mn = fminf(mn, sd[k]);
    }
    mx = kc_warp_max(mx);
    mn = fmaxf(kc_warp_min(mn), SCORE_STD_FLOOR);
    return (double)mx / (double)mn;
}

__device__ __forceinline__ float clampf(float v, float lo, float hi)
{
    return fminf(fmaxf(v, lo), hi);
}

__device__ __forceinline__ void put16(uint8_t *p, uint16_t v)
{
    *reinterpret_cast<uint16_t *>(p) = v;
}

/* Scratch of encode_matrix: kVecs vectors of L = max(rows, cols) floats,
 * then the best score (a double). */
enum { V_SCOL, V_SROW, V_BCOL, V_BROW, V_U, V_W, V_SDCOL, V_SDROW, V_SDROWU, kVecs };

/* Balance, quantize, fold and pack one matrix (spec steps 2-5). Output:
 * codes [rows][cols * BITS / 8], row_a and row_b fp16 [rows], col_s fp16
 * [cols]. */
template <int BITS>
__device__ void encode_matrix(const matrix &m, int iters, float *work, int L, uint8_t *codes,
                              uint8_t *row_a, uint8_t *row_b, uint8_t *col_s)
{
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int R = m.rows, C = m.cols;
    float *s_col = work + V_SCOL * L, *s_row = work + V_SROW * L;
    float *b_col = work + V_BCOL * L, *b_row = work + V_BROW * L;
    float *u = work + V_U * L, *w = work + V_W * L;
    float *sd_col = work + V_SDCOL * L, *sd_row = work + V_SDROW * L, *sd_row_u = work + V_SDROWU * L;
    double *best = reinterpret_cast<double *>(work + kVecs * L);
    int *improved = reinterpret_cast<int *>(best + 1);

    for (int j = tid; j < C; j += kThreads) s_col[j] = b_col[j] = u[j] = 1.0f;
    for (int i = tid; i < R; i += kThreads) s_row[i] = b_row[i] = w[i] = 1.0f;
    __syncthreads();
    /* The identity scaling, scored on the raw tile, is the starting best. */
    all_stds(m, true, w, nullptr, sd_col);
    all_stds(m, false, u, nullptr, sd_row);
    __syncthreads();
    if (warp == 0) {
        const double sc = std_ratio(sd_col, C);
        const double sr = std_ratio(sd_row, R);
        if (lane == 0) *best = sc + sr;
    }
    __syncthreads();

    for (int it = 0; it < iters; it++) {
        /* Column pass: sd_col holds the column stds of the current tile. */
        for (int j = tid; j < C; j += kThreads) {
            s_col[j] = clampf(s_col[j] * clampf(sd_col[j], STD_MIN, STD_MAX), SCALE_MIN, SCALE_MAX);
            u[j] = 1.0f / s_col[j];
        }
        __syncthreads();
        /* Row pass on the tile renormalized with the new column scales. */
        all_stds(m, false, u, nullptr, sd_row_u);
        __syncthreads();
        for (int i = tid; i < R; i += kThreads) {
            const float sd = w[i] * sd_row_u[i];
            s_row[i] = clampf(s_row[i] * clampf(sd, STD_MIN, STD_MAX), SCALE_MIN, SCALE_MAX);
            w[i] = 1.0f / s_row[i];
            sd_row[i] = w[i] * sd_row_u[i];
        }
        __syncthreads();
        /* Score the renormalized tile; its column stds feed the next pass. */
        all_stds(m, true, w, u, sd_col);
        __syncthreads();
        if (warp == 0) {
            const double sc = std_ratio(sd_col, C);
            const double sr = std_ratio(sd_row, R);
            if (lane == 0) {
                const double score = sc + sr;
                const int take = score <= *best * (1.0 + SCORE_TIE_RTOL); /* ties: later */
                if (take && score < *best) *best = score;
                *improved = take;
            }
        }
        __syncthreads();
        if (*improved) {
            for (int j = tid; j < C; j += kThreads) b_col[j] = s_col[j];
            for (int i = tid; i < R; i += kThreads) b_row[i] = s_row[i];
        }
        __syncthreads();
    }

    for (int j = tid; j < C; j += kThreads) put16(col_s + 2 * j, kc_f2h(b_col[j]));

    /* RTN per row of the balanced tile y = x / s_col / s_row, one warp per
     * row; fold the row's scale and minimum into its balance scale. */
    constexpr int PER = 8 / BITS;
    constexpr float QMAX = (float)((1 << BITS) - 1);
    const int row_bytes = C * BITS / 8;
    for (int i = warp; i < R; i += kWarps) {
        const float sr = b_row[i];
        float lo = INFINITY, hi = -INFINITY;
        for (int j = lane; j < C; j += 32) {
            const float y = __half2float(m.x[i * m.row_step + j * m.col_step]) / b_col[j] / sr;
            lo = fminf(lo, y);
            hi = fmaxf(hi, y);
        }
        lo = kc_warp_min(lo);
        hi = kc_warp_max(hi);
        float scale = (hi - lo) / QMAX;
        if (!(scale >= RTN_SCALE_MIN)) scale = RTN_SCALE_MIN;
        for (int k = lane; k < row_bytes; k += 32) {
            uint32_t byte = 0;
#pragma unroll
            for (int e = 0; e < PER; e++) {
                const int j = k * PER + e;
                const float y = __half2float(m.x[i * m.row_step + j * m.col_step]) / b_col[j] / sr;
                const float q = fminf(rintf((y - lo) / scale), QMAX);
                byte |= (uint32_t)q << (e * BITS);
            }
            codes[(size_t)i * row_bytes + k] = (uint8_t)byte;
        }
        if (lane == 0) {
            put16(row_a + 2 * i, kc_f2h(sr * scale));
            put16(row_b + 2 * i, kc_f2h(sr * lo));
        }
    }
    __syncthreads();
}

template <int D, int G, int KB, int VB>
__global__ void __launch_bounds__(kThreads)
commit_kernel(kc_geom g, const int32_t *src_pages, const int32_t *dst_blocks, int iters)
{
    const int p = src_pages[blockIdx.x], b = dst_blocks[blockIdx.x], h = blockIdx.y;
    if (p < 0 || b < 0 || p >= g.kv.n_fp16_pages || b >= g.kv.n_blocks) return;
    KC_DYNAMIC_SMEM(uint4, smem_u4);
    __half *x = reinterpret_cast<__half *>(smem_u4);
    constexpr int L = G > D ? G : D;
    float *work = reinterpret_cast<float *>(x + G * D);

    /* K then V of this head: one 16-byte aligned fp16 tile (paged.h) */
    const uint4 *page = reinterpret_cast<const uint4 *>(kvarn_paged_page_k(&g.kv, p, h));
    uint8_t *rec = kvarn_paged_record(&g.kv, b, h);
    constexpr int N4 = G * D * 2 / 16;

    /* K: D rows (channels) x G columns (tokens). */
    for (int k = threadIdx.x; k < N4; k += kThreads) smem_u4[k] = page[k];
    __syncthreads();
    encode_matrix<KB>(matrix{x, D, G, 1, D}, iters, work, L, rec + g.k_codes_off,
                      rec + g.k_a_off, rec + g.k_b_off, rec + g.k_stok_off);
    /* V: G rows (tokens) x D columns (channels). */
    for (int k = threadIdx.x; k < N4; k += kThreads) smem_u4[k] = page[N4 + k];
    __syncthreads();
    encode_matrix<VB>(matrix{x, G, D, D, 1}, iters, work, L, rec + g.v_codes_off,
                      rec + g.v_a_off, rec + g.v_b_off, rec + g.v_schan_off);
    /* Zero the record's padding so that records are byte-reproducible. */
    for (int k = g.payload_bytes + (int)threadIdx.x; k < g.record_bytes; k += kThreads) rec[k] = 0;
}

template <int D, int G, int KB, int VB>
cudaError_t launch_commit(const kc_geom &g, const int32_t *src, const int32_t *dst, int n,
                          int iters, cudaStream_t s)
{
    constexpr int L = G > D ? G : D;
    const size_t smem = (size_t)G * D * 2 + ((size_t)kVecs * L + 4) * sizeof(float);
    auto kernel = commit_kernel<D, G, KB, VB>;
    if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute((const void *)kernel,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
    }
    KC_LAUNCH(kernel, dim3((unsigned)n, (unsigned)g.Hk), kThreads, smem, s, g, src, dst, iters);
    return cudaGetLastError();
}

} // namespace

cudaError_t kc_launch_commit(const kc_geom &g, const int32_t *src_pages,
                             const int32_t *dst_blocks, int num_tiles, int iters,
                             cudaStream_t s)
{
#define KC_COMMIT_IF(D_, G_, KB_, VB_)                                                  \
    if (g.D == D_ && g.G == G_ && g.key_bits == KB_ && g.value_bits == VB_)            \
        return launch_commit<D_, G_, KB_, VB_>(g, src_pages, dst_blocks, num_tiles, iters, s);
#define KC_COMMIT_D(D_) KVARN_CUDA_KVARN_PRESETS(KC_COMMIT_IF, D_)
    KVARN_CUDA_HEAD_DIMS(KC_COMMIT_D)
#undef KC_COMMIT_D
#undef KC_COMMIT_IF
    return cudaErrorInvalidValue;
}
