/*
 * api.cu -- the host side of the CUDA backend (include/kvarn/cuda.h):
 * argument checks, the served-format table lookup, the device view of the
 * record layout, split-K planning and workspace sizes, and the mapping of
 * CUDA errors to kvarn_status. Everything here up to the launches runs
 * without a GPU.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cache/paged_check.h"
#include "cuda/common.cuh"
#include "kvarn/cuda.h"
#include "kvarn/record.h"

namespace {

kvarn_status map_cuda_error(cudaError_t e)
{
    switch (e) {
    case cudaSuccess:
        return KVARN_OK;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInitializationError:
    case cudaErrorDevicesUnavailable:
    case cudaErrorStubLibrary:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorInvalidDevice:
        return KVARN_ERR_NO_DEVICE;
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorInvalidDeviceFunction:
    case cudaErrorLaunchOutOfResources:
    case cudaErrorInvalidConfiguration:
    case cudaErrorInvalidValue:
        return KVARN_ERR_UNSUPPORTED;
    default:
        return KVARN_ERR_STATE;
    }
}

bool served_head_dim(int D)
{
#define KC_D(D_) if (D == D_) return true;
    KVARN_CUDA_HEAD_DIMS(KC_D)
#undef KC_D
    return false;
}

bool served_format(const kvarn_format *f, int D)
{
    /* mean-centred KVarN formats have no device kernels yet */
    if (f->centred) return false;
    if (f->kind == KVARN_KIND_KVARN) {
#define KC_P(D_, G_, KB_, VB_) \
    if (D == D_ && f->tile_tokens == G_ && f->key_bits == KB_ && f->value_bits == VB_) return true;
#define KC_PD(D_) KVARN_CUDA_KVARN_PRESETS(KC_P, D_)
        KVARN_CUDA_HEAD_DIMS(KC_PD)
#undef KC_PD
#undef KC_P
        return false;
    }
#define KC_T(D_, KIND_) if (D == D_ && f->kind == KIND_) return true;
#define KC_TD(D_) KVARN_CUDA_TOKEN_KINDS(KC_T, D_)
    KVARN_CUDA_HEAD_DIMS(KC_TD)
#undef KC_TD
#undef KC_T
    return false;
}

/* Fill the device view; kv must have passed kvarn_cuda_check_kv. */
kc_geom make_geom(const kvarn_paged_kv *kv)
{
    kvarn_record_layout L;
    kvarn_record_layout_get(&kv->fmt, kv->head_dim, &L);
    kc_geom g;
    memset(&g, 0, sizeof g);
    g.kv = *kv;
    g.kind = (int)kv->fmt.kind;
    g.D = kv->head_dim;
    g.G = kv->block_size;
    g.Hk = kv->n_kv_heads;
    g.key_bits = kv->fmt.key_bits;
    g.value_bits = kv->fmt.value_bits;
    g.k_codes_off = (int)L.k_codes_off;
    g.k_a_off = (int)L.k_a_off;
    g.k_b_off = (int)L.k_b_off;
    g.k_stok_off = (int)L.k_stok_off;
    g.v_codes_off = (int)L.v_codes_off;
    g.v_schan_off = (int)L.v_schan_off;
    g.v_a_off = (int)L.v_a_off;
    g.v_b_off = (int)L.v_b_off;
    g.payload_bytes = (int)L.payload_bytes;
    g.record_bytes = (int)L.record_bytes;
    return g;
}

bool aligned(const void *p, size_t a) { return ((uintptr_t)p % a) == 0; }

/* Whether the tensor-core kernel (attn_mma.cu) serves this geometry and plan
 * (dispatch.h KVARN_CUDA_MMA_*) and the environment's KVARN_CUDA_MATRIX is
 * not "0" (the kernel off, for a comparison or a suspicion); a multi-query
 * call also needs a device of compute capability 8.0 or later
 * (device_has_bf16_mma). */
bool matrix_serves(const kvarn_paged_kv *kv, const kvarn_cuda_attn_shape *shape)
{
    const char *env = getenv("KVARN_CUDA_MATRIX");
    if (env != NULL && strcmp(env, "0") == 0) return false;
    bool d = false;
#define KC_D(D_) d = d || kv->head_dim == D_;
    KVARN_CUDA_MMA_HEAD_DIMS(KC_D)
#undef KC_D
    return d && kv->fmt.kind == KVARN_KIND_KVARN &&
           shape->max_query_len >= KVARN_CUDA_MMA_MIN_QUERIES;
}

/* Whether plan is one kvarn_cuda_attn_plan_make made for kv: KVARN_OK, the
 * plan's own error (kv or shape), or KVARN_ERR_INVALID_ARG when its group
 * size or row chunks are not those of its shape (num_splits is the
 * caller's to change, within [1, KVARN_CUDA_MAX_SPLITS]). */
kvarn_status plan_matches(const kvarn_paged_kv *kv, const kvarn_cuda_attn_plan *plan)
{
    kvarn_cuda_attn_plan check;
    const kvarn_status st = kvarn_cuda_attn_plan_make(kv, &plan->shape, 0, &check);
    if (st != KVARN_OK) return st;
    if (plan->group_size != check.group_size || plan->row_chunks != check.row_chunks ||
        plan->num_splits < 1 || plan->num_splits > KVARN_CUDA_MAX_SPLITS)
        return KVARN_ERR_INVALID_ARG;
    return KVARN_OK;
}

/* The current device's compute capability is 8.0 or later (bf16 mma.sync). */
bool device_has_bf16_mma(void)
{
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
        return false;
    return major >= 8;
}

} // namespace

extern "C" {

kvarn_status kvarn_cuda_device_count(int *count)
{
    if (count == NULL) return KVARN_ERR_INVALID_ARG;
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n <= 0) {
        (void)cudaGetLastError(); /* clear the error for later calls */
        *count = 0;
        return KVARN_ERR_NO_DEVICE;
    }
    *count = n;
    return KVARN_OK;
}

kvarn_status kvarn_cuda_sm_count(int device, int *num_sms)
{
    if (num_sms == NULL || device < 0) return KVARN_ERR_INVALID_ARG;
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
        (void)cudaGetLastError();
        return KVARN_ERR_NO_DEVICE;
    }
    *num_sms = n;
    return KVARN_OK;
}

kvarn_status kvarn_cuda_supports(const kvarn_format *fmt, int head_dim)
{
    if (fmt == NULL) return KVARN_ERR_INVALID_ARG;
    kvarn_status st = kvarn_format_check_head_dim(fmt, head_dim);
    if (st != KVARN_OK) return st;
    if (!served_head_dim(head_dim)) return KVARN_ERR_UNSUPPORTED_HEAD_DIM;
    return served_format(fmt, head_dim) ? KVARN_OK : KVARN_ERR_UNSUPPORTED;
}

kvarn_status kvarn_cuda_check_kv(const kvarn_paged_kv *kv)
{
    if (kv == NULL) return KVARN_ERR_INVALID_ARG;
    kvarn_status st = kvarn_cuda_supports(&kv->fmt, kv->head_dim);
    if (st != KVARN_OK) return st;
    kvarn_record_layout L;
    st = kvarn_record_layout_get(&kv->fmt, kv->head_dim, &L);
    if (st != KVARN_OK) return st;
    const bool kvarn = kv->fmt.kind == KVARN_KIND_KVARN;
    if (kv->n_kv_heads < 1 || kv->n_kv_heads > 65535 || kv->sink_tiles < 0)
        return KVARN_ERR_INVALID_ARG;
    if (kvarn ? kv->block_size != kv->fmt.tile_tokens
              : (kv->block_size < 1 || kv->block_size > KVARN_CUDA_MAX_BLOCK))
        return KVARN_ERR_INVALID_ARG;
    if (!kvarn && kv->sink_tiles != 0) return KVARN_ERR_INVALID_ARG;
    /* A sink shorter than a tile (paged.h, sink_partial > 0) is read by the
     * CPU kernels only; the CUDA kernels serve whole sink tiles. */
    if (kv->sink_partial != 0) return KVARN_ERR_UNSUPPORTED;
    /* Small tail pages (paged.h, 0 < tail_page_tokens < G): CPU kernels
     * only as well; the CUDA kernels read whole tail pages. */
    if (kv->tail_page_tokens != 0 && kv->tail_page_tokens != kv->block_size)
        return KVARN_ERR_UNSUPPORTED;
    /* Staging below fp16 (paged.h, int8 token records): CPU kernels only. */
    if (kv->staging != KVARN_STAGING_FP16) return KVARN_ERR_UNSUPPORTED;
    if (kv->blocks == NULL || kv->n_blocks < 1 ||
        (kvarn && (kv->fp16_pages == NULL || kv->n_fp16_pages < 1)))
        return KVARN_ERR_INVALID_ARG;
    if (!aligned(kv->blocks, 4) || kv->block_stride % 4 || kv->record_stride % 4 ||
        kv->token_record_bytes % 4 ||
        (kvarn && (!aligned(kv->fp16_pages, 16) || kv->page_stride % 16 ||
                   kv->page_head_stride % 16)))
        return KVARN_ERR_INVALID_ARG;
    /* Records, blocks and fp16 pages: the check the CPU store, commit and
     * attention share (cache/paged_check.h), products checked; a size too
     * short for what it holds is KVARN_ERR_BUFFER_TOO_SMALL here. */
    return kvarn__paged_check_arenas(kv, &L, KVARN_PAGED_NEED_BLOCKS | KVARN_PAGED_NEED_PAGES,
                                     KVARN_ERR_BUFFER_TOO_SMALL);
}

kvarn_status kvarn_cuda_store(const kvarn_paged_kv *kv, kvarn_cuda_dtype dtype,
                              const void *k, const void *v,
                              const int64_t *slot_mapping, int num_tokens, void *stream)
{
    if (k == NULL || v == NULL || slot_mapping == NULL || num_tokens < 0 ||
        (dtype != KVARN_CUDA_F16 && dtype != KVARN_CUDA_BF16))
        return KVARN_ERR_INVALID_ARG;
    kvarn_status st = kvarn_cuda_check_kv(kv);
    if (st != KVARN_OK) return st;
    if (num_tokens == 0) return KVARN_OK;
    const kc_geom g = make_geom(kv);
    return map_cuda_error(kc_launch_store(g, (int)dtype, k, v, slot_mapping, num_tokens,
                                          (cudaStream_t)stream));
}

kvarn_status kvarn_cuda_commit(const kvarn_paged_kv *kv,
                               const int32_t *src_pages, const int32_t *dst_blocks,
                               int num_tiles, const kvarn_codec_opts *opts, void *stream)
{
    if (kv == NULL || src_pages == NULL || dst_blocks == NULL || num_tiles < 0)
        return KVARN_ERR_INVALID_ARG;
    kvarn_codec_opts o = KVARN_CODEC_OPTS_DEFAULT;
    if (opts != NULL) o = *opts;
    if (o.balance_iters < 0 || o.balance_iters > 64 ||
        (o.rtn_range < KVARN_RTN_MINMAX || o.rtn_range > KVARN_RTN_MSE_V))
        return KVARN_ERR_INVALID_ARG;
    /* the device commit runs the spec's min/max range only */
    if (o.rtn_range != KVARN_RTN_MINMAX) return KVARN_ERR_UNSUPPORTED;
    kvarn_status st = kvarn_cuda_check_kv(kv);
    if (st != KVARN_OK) return st;
    if (kv->fmt.kind != KVARN_KIND_KVARN) return KVARN_ERR_INVALID_ARG;
    if (num_tiles == 0) return KVARN_OK;
    const kc_geom g = make_geom(kv);
    return map_cuda_error(kc_launch_commit(g, src_pages, dst_blocks, num_tiles,
                                           o.balance_iters, (cudaStream_t)stream));
}

kvarn_status kvarn_cuda_attn_plan_make(const kvarn_paged_kv *kv,
                                  const kvarn_cuda_attn_shape *shape, int num_sms,
                                  kvarn_cuda_attn_plan *plan)
{
    if (shape == NULL || plan == NULL) return KVARN_ERR_INVALID_ARG;
    kvarn_status st = kvarn_cuda_check_kv(kv);
    if (st != KVARN_OK) return st;
    const kvarn_cuda_attn_shape *s = shape;
    const int Hk = kv->n_kv_heads, G = kv->block_size;
    if (s->num_seqs < 1 || s->num_seqs > 65535 || s->num_heads < 1 ||
        s->num_heads % Hk != 0 || s->max_blocks_per_seq < 1 || s->max_seq_len < 0 ||
        (int64_t)s->max_seq_len > (int64_t)s->max_blocks_per_seq * G ||
        s->max_query_len < 1 || s->sliding_window < 0 ||
        !(s->softmax_scale > 0.0f) || !isfinite(s->softmax_scale))
        return KVARN_ERR_INVALID_ARG;
    const int gs = s->num_heads / Hk;
    const int64_t rows = (int64_t)s->max_query_len * gs;
    const int64_t chunks = (rows + KVARN_CUDA_ROWS - 1) / KVARN_CUDA_ROWS;
    if (chunks * Hk > 0x7fffffff) return KVARN_ERR_INVALID_ARG;

    /* Split the context when the grid alone would leave SMs idle: aim at
     * two thread blocks per SM, each split at least 256 tokens long. The
     * tensor-core kernel's blocks serve 8 chunks each. */
    const int64_t per_block = matrix_serves(kv, s) ? KVARN_CUDA_MMA_ROWS / KVARN_CUDA_ROWS : 1;
    const int64_t blocks = (int64_t)s->num_seqs * Hk * ((chunks + per_block - 1) / per_block);
    const int64_t base = (int64_t)s->num_seqs * Hk * chunks;
    int64_t splits = 1;
    if (num_sms > 0 && blocks < 2 * (int64_t)num_sms) {
        splits = (2 * (int64_t)num_sms + blocks - 1) / blocks;
        int64_t cap = s->max_seq_len / 256;
        if (cap < 1) cap = 1;
        if (splits > cap) splits = cap;
        if (splits > KVARN_CUDA_MAX_SPLITS) splits = KVARN_CUDA_MAX_SPLITS;
    }
    kvarn_cuda_attn_plan p;
    memset(&p, 0, sizeof p);
    p.shape = *s;
    p.group_size = gs;
    p.row_chunks = (int)chunks;
    p.num_splits = (int)splits;
    p.workspace_bytes = splits > 1 ? (size_t)base * (size_t)splits *
                                         kc_partial_floats(kv->head_dim) * sizeof(float)
                                   : 0;
    *plan = p;
    return KVARN_OK;
}

kvarn_status kvarn_cuda_attention(const kvarn_paged_kv *kv,
                                  const kvarn_cuda_attn_plan *plan,
                                  const kvarn_cuda_attn_args *args,
                                  void *workspace, size_t workspace_bytes, void *stream)
{
    if (plan == NULL || args == NULL) return KVARN_ERR_INVALID_ARG;
    kvarn_status st = kvarn_cuda_check_kv(kv);
    if (st != KVARN_OK) return st;
    st = plan_matches(kv, plan);
    if (st != KVARN_OK) return st;
    const size_t need = plan->num_splits > 1
                            ? (size_t)plan->shape.num_seqs * kv->n_kv_heads * plan->row_chunks *
                                  plan->num_splits * kc_partial_floats(kv->head_dim) * sizeof(float)
                            : 0;
    if (plan->workspace_bytes != need) return KVARN_ERR_INVALID_ARG;
    if (args->q == NULL || args->out == NULL || args->block_tables == NULL ||
        args->seq_lens == NULL ||
        (kv->fmt.kind == KVARN_KIND_KVARN && args->committed_tiles == NULL))
        return KVARN_ERR_INVALID_ARG;
    if (need > 0 && (workspace == NULL || !aligned(workspace, 16))) return KVARN_ERR_INVALID_ARG;
    if (workspace_bytes < need) return KVARN_ERR_BUFFER_TOO_SMALL;

    kc_attn a;
    memset(&a, 0, sizeof a);
    a.g = make_geom(kv);
    a.q = args->q;
    a.out = args->out;
    a.block_tables = args->block_tables;
    a.seq_lens = args->seq_lens;
    a.committed_tiles = args->committed_tiles;
    a.query_start_loc = args->query_start_loc;
    a.max_blocks = plan->shape.max_blocks_per_seq;
    a.Hq = plan->shape.num_heads;
    a.group_size = plan->group_size;
    a.row_chunks = plan->row_chunks;
    a.num_splits = plan->num_splits;
    a.window = plan->shape.sliding_window;
    a.scale_log2 = plan->shape.softmax_scale * 1.4426950408889634f;
    a.ws = plan->num_splits > 1 ? static_cast<float *>(workspace) : nullptr;
    a.sinks = args->sinks;
    a.matrix = args->query_start_loc != NULL && matrix_serves(kv, &plan->shape) &&
               device_has_bf16_mma() && kc_attn_mma_compiled();
    return map_cuda_error(kc_launch_attn(a, plan->shape.num_seqs, (cudaStream_t)stream));
}

kvarn_status kvarn_cuda_attn_kernel_info_get(const kvarn_paged_kv *kv,
                                             const kvarn_cuda_attn_plan *plan,
                                             kvarn_cuda_attn_kernel_info *info)
{
    if (plan == NULL || info == NULL) return KVARN_ERR_INVALID_ARG;
    const kvarn_status st = plan_matches(kv, plan);
    if (st != KVARN_OK) return st;
    kvarn_cuda_attn_kernel_info r;
    memset(&r, 0, sizeof r);
    r.scores = r.sums = KVARN_ATTN_ARITH_FP32;
    if (matrix_serves(kv, &plan->shape)) {
        r.matrix = 1;
        r.matrix_rows = KVARN_CUDA_MMA_ROWS;
        r.matrix_min_queries = KVARN_CUDA_MMA_MIN_QUERIES;
        r.matrix_scores = r.matrix_sums = KVARN_ATTN_ARITH_BF16;
    } else {
        r.matrix_scores = r.matrix_sums = KVARN_ATTN_ARITH_FP32;
    }
    *info = r;
    return KVARN_OK;
}

} // extern "C"
