"""ctypes bindings to libkvarn.so (and, on a GPU, libkvarn_cuda.so): the
few C calls the plug-in makes.

Each library is found, in order, at $KVARN_LIBRARY / $KVARN_CUDA_LIBRARY,
next to this file, or in the repository's build/ (the package installed
editable from python/). Every call hands data_ptr()s of existing tensors:
nothing is copied.
"""
import ctypes
import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def _find_library(file: str = "libkvarn.so", env: str = "KVARN_LIBRARY",
                  target: str = "kvarn_shared") -> str:
    cands = [os.environ.get(env, ""),
             os.path.join(_HERE, file),
             os.path.join(_HERE, "..", "..", "build", file)]
    for c in cands:
        if c and os.path.exists(c):
            return os.path.abspath(c)
    raise RuntimeError(
        f"kvarn_vllm: {file} not found (looked at ${env}, "
        f"{cands[1]}, {cands[2]}); build it with "
        f"`cmake -S . -B build && cmake --build build --target {target}`")


KIND_KVARN = 6


class Format(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("name", ctypes.c_char * 32),
                ("tile_tokens", ctypes.c_int), ("key_bits", ctypes.c_int),
                ("value_bits", ctypes.c_int), ("per_tile", ctypes.c_int),
                ("centred", ctypes.c_int)]


class PagedKV(ctypes.Structure):
    """include/kvarn/paged.h: kvarn_paged_kv."""
    _fields_ = [("fmt", Format), ("head_dim", ctypes.c_int),
                ("n_kv_heads", ctypes.c_int), ("block_size", ctypes.c_int),
                ("sink_tiles", ctypes.c_int), ("blocks", ctypes.c_void_p),
                ("block_stride", ctypes.c_size_t), ("record_stride", ctypes.c_size_t),
                ("token_record_bytes", ctypes.c_size_t), ("fp16_pages", ctypes.c_void_p),
                ("page_stride", ctypes.c_size_t), ("page_head_stride", ctypes.c_size_t),
                ("n_blocks", ctypes.c_int), ("n_fp16_pages", ctypes.c_int),
                # sink shorter than a tile (paged.h): unused here, left 0
                ("sink_partial", ctypes.c_int), ("fp16_sinks", ctypes.c_void_p),
                ("sink_stride", ctypes.c_size_t), ("sink_head_stride", ctypes.c_size_t),
                ("n_sink_slots", ctypes.c_int),
                # small tail pages (paged.h): unused here, left 0
                ("tail_page_tokens", ctypes.c_int), ("fp16_tail_pages", ctypes.c_void_p),
                ("tail_page_stride", ctypes.c_size_t),
                ("tail_page_head_stride", ctypes.c_size_t), ("n_tail_pages", ctypes.c_int),
                # staging below fp16 (paged.h): KVARN_STAGING, settings.Settings.staging_kind
                ("staging", ctypes.c_int), ("staging_record_bytes", ctypes.c_size_t)]


class SeqView(ctypes.Structure):
    _fields_ = [("block_table", ctypes.c_void_p), ("seq_len", ctypes.c_int),
                ("committed_tiles", ctypes.c_int), ("sink_slot", ctypes.c_int),
                ("tail_pages", ctypes.c_void_p)]


class AttnOpts(ctypes.Structure):
    _fields_ = [("softmax_scale", ctypes.c_float), ("sliding_window", ctypes.c_int),
                ("causal", ctypes.c_int), ("testing", ctypes.c_void_p),
                ("sinks", ctypes.c_void_p), ("io_bf16", ctypes.c_int)]


class AttnKernelInfo(ctypes.Structure):
    """include/kvarn/attn.h: kvarn_attn_kernel_info (arithmetic fields:
    kvarn_attn_arith values, ARITH_NAMES)."""
    _fields_ = [("level", ctypes.c_char_p), ("scores", ctypes.c_int), ("sums", ctypes.c_int),
                ("staged_scores", ctypes.c_int), ("staged_sums", ctypes.c_int),
                ("matrix", ctypes.c_char_p), ("matrix_rows", ctypes.c_int),
                ("matrix_scores", ctypes.c_int), ("matrix_sums", ctypes.c_int),
                ("matrix_staged", ctypes.c_int)]


# include/kvarn/attn.h kvarn_attn_arith
ARITH_NAMES = {0: "fp32", 1: "int16", 2: "int8", 3: "u8", 4: "bf16x2", 5: "bf16"}


class CacheOpts(ctypes.Structure):
    """include/kvarn/cache.h: kvarn_cache_opts."""
    _fields_ = [("format", Format), ("n_layers", ctypes.c_int), ("n_kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("block_size", ctypes.c_int),
                ("sink_tiles", ctypes.c_int), ("budget_bytes", ctypes.c_uint64),
                ("max_seqs", ctypes.c_int), ("max_seq_len", ctypes.c_int),
                ("n_pages", ctypes.c_int), ("balance_iters", ctypes.c_int),
                ("allocator", ctypes.c_void_p), ("sink_tokens", ctypes.c_int),
                ("tail_page_tokens", ctypes.c_int), ("n_tail_pages", ctypes.c_int),
                ("rtn_range", ctypes.c_int),
                ("staging", ctypes.c_int)]


class CacheInfo(ctypes.Structure):
    """include/kvarn/cache.h: kvarn_cache_info."""
    _fields_ = [("format", Format), ("n_layers", ctypes.c_int), ("n_kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("block_size", ctypes.c_int),
                ("sink_tiles", ctypes.c_int), ("n_blocks", ctypes.c_int),
                ("n_pages", ctypes.c_int), ("max_seqs", ctypes.c_int),
                ("max_seq_len", ctypes.c_int), ("record_stride", ctypes.c_size_t),
                ("block_stride", ctypes.c_size_t), ("token_record_bytes", ctypes.c_size_t),
                ("block_bytes", ctypes.c_size_t), ("page_bytes", ctypes.c_size_t),
                ("arena_bytes", ctypes.c_uint64), ("capacity_tokens", ctypes.c_uint64),
                ("sink_tokens", ctypes.c_int), ("sink_partial", ctypes.c_int),
                ("sink_bytes", ctypes.c_size_t), ("tail_page_tokens", ctypes.c_int),
                ("n_tail_pages", ctypes.c_int), ("tail_page_bytes", ctypes.c_size_t),
                ("staging", ctypes.c_int), ("staging_record_bytes", ctypes.c_size_t)]


class CudaAttnShape(ctypes.Structure):
    """include/kvarn/cuda.h: kvarn_cuda_attn_shape."""
    _fields_ = [("num_seqs", ctypes.c_int), ("num_heads", ctypes.c_int),
                ("max_blocks_per_seq", ctypes.c_int), ("max_seq_len", ctypes.c_int),
                ("max_query_len", ctypes.c_int), ("sliding_window", ctypes.c_int),
                ("softmax_scale", ctypes.c_float)]


class CudaAttnPlan(ctypes.Structure):
    """include/kvarn/cuda.h: kvarn_cuda_attn_plan."""
    _fields_ = [("shape", CudaAttnShape), ("group_size", ctypes.c_int),
                ("row_chunks", ctypes.c_int), ("num_splits", ctypes.c_int),
                ("workspace_bytes", ctypes.c_size_t)]


class CudaAttnArgs(ctypes.Structure):
    """include/kvarn/cuda.h: kvarn_cuda_attn_args (device pointers)."""
    _fields_ = [("q", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("block_tables", ctypes.c_void_p), ("seq_lens", ctypes.c_void_p),
                ("committed_tiles", ctypes.c_void_p), ("query_start_loc", ctypes.c_void_p),
                ("sinks", ctypes.c_void_p)]


CUDA_F16, CUDA_BF16 = 0, 1   # kvarn_cuda_dtype

_lib = None
_cuda = None


def cuda_lib():
    """libkvarn_cuda.so (built when nvcc is found: target kvarn_cuda_shared),
    with its signatures set. Testing only: $KVARN_TEST_CUDA_EMULATOR names a
    Python file whose `library()` returns an object with the same functions
    (tests/vllm/cuda_emulator.py), so that the CUDA calls the backend makes
    can be run on a machine without a GPU (docs/vllm.md "GPU")."""
    global _cuda
    if _cuda is not None:
        return _cuda
    emu = os.environ.get("KVARN_TEST_CUDA_EMULATOR", "")
    if emu:
        import importlib.util
        spec = importlib.util.spec_from_file_location("kvarn_cuda_emulator", emu)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _cuda = mod.library()
        return _cuda
    C = ctypes.CDLL(_find_library("libkvarn_cuda.so", "KVARN_CUDA_LIBRARY", "kvarn_cuda_shared"))
    P, I = ctypes.c_void_p, ctypes.c_int
    pkv = ctypes.POINTER(PagedKV)
    sig = {
        "kvarn_cuda_sm_count": (I, [I, ctypes.POINTER(I)]),
        "kvarn_cuda_check_kv": (I, [pkv]),
        "kvarn_cuda_store": (I, [pkv, I, P, P, P, I, P]),
        "kvarn_cuda_commit": (I, [pkv, P, P, I, P, P]),
        "kvarn_cuda_attn_plan_make": (I, [pkv, ctypes.POINTER(CudaAttnShape), I,
                                          ctypes.POINTER(CudaAttnPlan)]),
        "kvarn_cuda_attention": (I, [pkv, ctypes.POINTER(CudaAttnPlan),
                                     ctypes.POINTER(CudaAttnArgs), P, ctypes.c_size_t, P]),
    }
    for name, (res, args) in sig.items():
        f = getattr(C, name)
        f.restype, f.argtypes = res, args
    _cuda = C
    return C


def lib():
    global _lib
    if _lib is not None:
        return _lib
    L = ctypes.CDLL(_find_library())
    P, I, Z, S = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_char_p
    sig = {
        "kvarn_strerror": (S, [I]),
        "kvarn_format_parse": (I, [S, ctypes.POINTER(Format)]),
        "kvarn_format_check_head_dim": (I, [ctypes.POINTER(Format), I]),
        "kvarn_format_explain": (S, [I, S, I, ctypes.c_char_p, Z]),
        "kvarn_record_bytes": (Z, [ctypes.POINTER(Format), I]),
        "kvarn_paged_check": (I, [ctypes.POINTER(PagedKV)]),
        "kvarn_paged_store": (I, [ctypes.POINTER(PagedKV), P, P, P, I]),
        "kvarn_paged_commit_workspace_bytes": (Z, [ctypes.POINTER(PagedKV)]),
        "kvarn_paged_commit": (I, [ctypes.POINTER(PagedKV), P, P, I, P, P, Z]),
        "kvarn_paged_commit_exact": (I, [ctypes.POINTER(PagedKV), P, P, I, P, P, I, P, P,
                                         Z]),
        "kvarn_attn_workspace_bytes": (Z, [ctypes.POINTER(PagedKV), I, I, I, I,
                                           ctypes.POINTER(AttnOpts)]),
        "kvarn_attn_multi": (I, [ctypes.POINTER(PagedKV), P, I, P, I, P, P,
                                 ctypes.POINTER(AttnOpts), P, P, Z]),
        "kvarn_attn_kernel_info_get": (I, [ctypes.POINTER(Format), I, I,
                                           ctypes.POINTER(AttnOpts),
                                           ctypes.POINTER(AttnKernelInfo)]),
        "kvarn_thread_pool_create": (I, [I, ctypes.POINTER(P)]),
        "kvarn_thread_pool_size": (I, [P]),
        "kvarn_cache_plan": (I, [ctypes.POINTER(CacheOpts), ctypes.POINTER(CacheInfo)]),
        "kvarn_cache_staging_parse": (I, [S, ctypes.POINTER(I)]),
        "kvarn_cache_staging_name": (S, [I]),
    }
    for name, (res, args) in sig.items():
        f = getattr(L, name)
        f.restype, f.argtypes = res, args
    _lib = L
    return L


class KvarnError(RuntimeError):
    """A kvarn call failed; .status is the library's kvarn_status (0 when
    the error is the plug-in's own)."""
    status = 0


ERR_BUFFER_TOO_SMALL = -5   # kvarn.h KVARN_ERR_BUFFER_TOO_SMALL


def check(status: int, what: str) -> None:
    if status != 0:
        msg = lib().kvarn_strerror(status).decode()
        err = KvarnError(f"kvarn: {what} failed: {msg} (status {status})")
        err.status = status
        raise err


def is_kvarn_dtype(name) -> bool:
    """Whether a --kv-cache-dtype value is the plug-in's (a kvarn_* name,
    served by the kvarn backend) rather than vLLM's own. Here, not in
    backend.py, so that a process can check names without importing the
    backend (and torch and vLLM's attention modules with it)."""
    return isinstance(name, str) and name.startswith("kvarn_")


# The plug-in's names of the library's per-token formats (include/kvarn/
# kvarn.h: one record per token and KV head, data-derived scales;
# docs/formats.md), served as whole-cache dtypes (docs/vllm.md "Per-token
# formats"): prefixed so that they cannot clash with vLLM's own names
# (vLLM's fp8_e4m3 is a scale-less fp8 cache).
PER_TOKEN_DTYPES = {"kvarn_int8": "int8", "kvarn_int4": "int4",
                    "kvarn_fp8_e4m3": "fp8_e4m3", "kvarn_fp8_e5m2": "fp8_e5m2"}


def is_per_token_dtype(name) -> bool:
    """Whether a --kv-cache-dtype names one of the library's per-token
    formats (PER_TOKEN_DTYPES): records written at once at each token's
    slot, no staging pool, no commit."""
    return isinstance(name, str) and name in PER_TOKEN_DTYPES


MLA_PREFIX = "kvarn_mla_"   # MLA latent records (include/kvarn/mla.h, mla_backend.py)


def is_mla_dtype(name) -> bool:
    """Whether a --kv-cache-dtype names an MLA record format (kvarn_mla_*),
    served by mla_backend.KvarnMLABackend; like is_kvarn_dtype, importable
    without a backend."""
    return isinstance(name, str) and name.startswith(MLA_PREFIX)


def mla_dtype_names() -> list:
    """The kvarn_mla_* names the plug-in adds to vLLM's cache dtypes (the C
    library's kvarn_mla_format_parse accepts exactly these)."""
    return [f"{MLA_PREFIX}k{b}{r}_g{g}" for b in (4, 2, 8) for r in ("", "r8", "r16")
            for g in (128, 64)]


def parse_format(name: str, head_dim: int = 0) -> Format:
    """The C library's own parse; an unknown name or unserved head_dim raises
    ValueError with the library's explanation (what is accepted)."""
    L = lib()
    f = Format()
    lib_name = PER_TOKEN_DTYPES.get(name, name)   # kvarn_int8 -> the library's int8
    st = L.kvarn_format_parse(lib_name.encode(), ctypes.byref(f))
    if st == 0 and head_dim:
        st = L.kvarn_format_check_head_dim(ctypes.byref(f), head_dim)
    if st != 0:
        buf = ctypes.create_string_buffer(1024)
        L.kvarn_format_explain(st, lib_name.encode(), head_dim, buf, len(buf))
        msg = buf.value.decode()
        if is_kvarn_dtype(name) and not is_per_token_dtype(name):
            msg += (" (as a vLLM --kv-cache-dtype: the kvarn_k*v*_g* names above, or the "
                    "per-token formats " + ", ".join(PER_TOKEN_DTYPES) + ")")
        raise ValueError(msg)
    return f


def page_tokens(fmt: Format, block_size: int) -> int:
    """Tokens of one page of the vLLM cache for fmt: the KVarN tile, or
    for a per-token format (tile_tokens 1) vLLM's block size."""
    return fmt.tile_tokens if fmt.per_tile else int(block_size)


def record_bytes(fmt: Format, head_dim: int) -> int:
    return int(lib().kvarn_record_bytes(ctypes.byref(fmt), head_dim))


def attn_kernel_info(fmt: Format, head_dim: int, staging: int = 0) -> dict:
    """The kernels attention runs for fmt at head_dim (channels) with
    staging (a kvarn_staging value) on this CPU, default options
    (kvarn_attn_kernel_info_get): {"level": "avx512" / "avx2" / "scalar",
    "scores", "sums", "staged_scores", "staged_sums": "fp32" / "int16" /
    "int8" / "u8", and the matrix kernel's: "matrix" (None or its name),
    "matrix_rows", "matrix_scores", "matrix_sums", "matrix_staged" (the
    query tokens from which its items' staged tokens take it too; 0:
    never)}; raises KvarnError if the library refuses."""
    info = AttnKernelInfo()
    check(lib().kvarn_attn_kernel_info_get(ctypes.byref(fmt), head_dim, staging, None,
                                           ctypes.byref(info)), "attention kernel info")
    out = {"level": info.level.decode(),
           "matrix": info.matrix.decode() if info.matrix else None,
           "matrix_rows": info.matrix_rows, "matrix_staged": info.matrix_staged}
    for f in ("scores", "sums", "staged_scores", "staged_sums", "matrix_scores", "matrix_sums"):
        out[f] = ARITH_NAMES.get(getattr(info, f), str(getattr(info, f)))
    return out


# include/kvarn/paged.h kvarn_staging: fp16 rows, or records of the
# per-token format the staging is named after
STAGING_FP16, STAGING_INT8, STAGING_FP8_E4M3, STAGING_INT4 = 0, 1, 2, 3
STAGING_NAMES = {"fp16": STAGING_FP16, "int8": STAGING_INT8, "fp8_e4m3": STAGING_FP8_E4M3,
                 "int4": STAGING_INT4}


def staging_name(staging: int) -> str:
    """"fp16" / "int8" / "fp8_e4m3" / "int4" for a kvarn_staging value
    (STAGING_NAMES inverted)."""
    return next(n for n, v in STAGING_NAMES.items() if v == staging)


def parse_staging(name: str) -> int:
    """The kvarn_staging value of a staging name, by the C library's own
    parse (kvarn_cache_staging_parse: the names of STAGING_NAMES and the
    format table's aliases of their per-token formats, "fp8" for
    fp8_e4m3). Another name raises ValueError listing STAGING_NAMES."""
    out = ctypes.c_int(-1)
    if lib().kvarn_cache_staging_parse(name.encode(), ctypes.byref(out)) != 0:
        raise ValueError(f"kvarn: KVARN_STAGING must be one of {', '.join(STAGING_NAMES)} "
                         f"(fp8 is fp8_e4m3; got {name!r})")
    return out.value


def staged_bytes(fmt: Format, n_layers: int, n_kv_heads: int, head_dim: int,
                 sink_tiles: int, sink_partial: int = 0, staging: int = STAGING_FP16) -> tuple:
    """(page, sink slot, staged token record) bytes: one staging page (one
    tile of K and V, every layer and KV head), one sequence's sink slot (r =
    sink_partial tokens; 0 if r = 0), and, for a record staging (int8,
    fp8_e4m3, int4), one staged token-head record (0 for fp16), as kvarn_cache_plan works them out for a
    kvarn_cache of these dimensions: the one computation of the cache's
    staging memory (include/kvarn/cache.h) that the plug-in's pool is sized
    from."""
    o = CacheOpts()
    o.format = fmt
    o.n_layers, o.n_kv_heads, o.head_dim = n_layers, n_kv_heads, head_dim
    o.sink_tiles, o.max_seqs, o.n_pages = sink_tiles, 1, sink_tiles + 1
    o.staging = staging
    if sink_partial > 0:
        o.sink_tokens = sink_tiles * fmt.tile_tokens + sink_partial
    o.budget_bytes = 0  # sizes only, no blocks (kvarn_cache_plan)
    info = CacheInfo()
    check(lib().kvarn_cache_plan(ctypes.byref(o), ctypes.byref(info)), "cache plan")
    return int(info.page_bytes), int(info.sink_bytes), int(info.staging_record_bytes)


# ---------------------------------------------------------------- mla_*
# include/kvarn/mla.h: MLA latent records and absorbed attention. The
# calls take data pointers (ints: a tensor's data_ptr(), a NumPy array's
# ctypes.data) of contiguous fp32 arrays; shapes as mla.h says.

class MlaFormat(ctypes.Structure):
    """include/kvarn/mla.h: kvarn_mla_format."""
    _fields_ = [("latent_bits", ctypes.c_int), ("tile_tokens", ctypes.c_int),
                ("rope_bits", ctypes.c_int)]


_mla_ready = False


def mla_lib():
    """lib() with the mla_* signatures set."""
    global _mla_ready
    L = lib()
    if _mla_ready:
        return L
    P, I, Z, S = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_char_p
    pf = ctypes.POINTER(MlaFormat)
    sig = {
        "kvarn_mla_format_parse": (I, [S, pf]),
        "kvarn_mla_format_explain": (S, [I, S, I, I, ctypes.c_char_p, Z]),
        "kvarn_mla_check_dims": (I, [pf, I, I]),
        "kvarn_mla_record_bytes": (Z, [pf, I, I]),
        "kvarn_mla_workspace_bytes": (Z, [pf, I, I, I, I]),
        "kvarn_mla_encode": (I, [pf, I, I, P, P, P, P]),
        "kvarn_mla_decode": (I, [pf, I, I, P, P, P]),
        # records: const uint8_t *const * (an array of record addresses)
        "kvarn_mla_attn": (I, [pf, I, I, P, I, P, P, I, P, P, I, I, P, ctypes.c_float, P, P, P]),
        "kvarn_mla_attn_kernel_name": (S, [pf, I]),
        "kvarn_mla_attn_matrix_name": (S, [pf, I]),
    }
    for name, (res, args) in sig.items():
        f = getattr(L, name)
        f.restype, f.argtypes = res, args
    _mla_ready = True
    return L


def mla_parse(name: str, latent_dim: int = 0, rope_dim: int = 0) -> MlaFormat:
    """The C library's parse of an MLA format name (kvarn_mla_k4_g128, ...)
    and, with latent_dim, its dims check; failure raises ValueError with the
    library's explanation (what is accepted)."""
    L = mla_lib()
    f = MlaFormat()
    st = L.kvarn_mla_format_parse(name.encode(), ctypes.byref(f))
    if st == 0 and latent_dim:
        st = L.kvarn_mla_check_dims(ctypes.byref(f), latent_dim, rope_dim)
    if st != 0:
        buf = ctypes.create_string_buffer(512)
        L.kvarn_mla_format_explain(st, name.encode(), latent_dim, rope_dim, buf, len(buf))
        raise ValueError(buf.value.decode())
    return f


def mla_record_bytes(fmt: MlaFormat, latent_dim: int, rope_dim: int) -> int:
    return int(mla_lib().kvarn_mla_record_bytes(ctypes.byref(fmt), latent_dim, rope_dim))


def mla_workspace_bytes(fmt: MlaFormat, latent_dim: int, rope_dim: int,
                        n_rows: int = 0, n_heads: int = 0) -> int:
    return int(mla_lib().kvarn_mla_workspace_bytes(ctypes.byref(fmt), latent_dim, rope_dim,
                                                   n_rows, n_heads))


def mla_encode(fmt: MlaFormat, latent_dim: int, rope_dim: int, latent: int, rope: int,
               workspace: int, record: int) -> None:
    """One tile: latent fp32 [G][latent_dim], rope fp32 [G][rope_dim] ->
    record (mla_record_bytes); raises KvarnError (NaN/Inf: status -4)."""
    check(mla_lib().kvarn_mla_encode(ctypes.byref(fmt), latent_dim, rope_dim, latent, rope,
                                     workspace, record), "MLA encode")


def mla_decode(fmt: MlaFormat, latent_dim: int, rope_dim: int, record: int, latent: int,
               rope: int) -> None:
    check(mla_lib().kvarn_mla_decode(ctypes.byref(fmt), latent_dim, rope_dim, record, latent,
                                     rope), "MLA decode")


def mla_attn(fmt: MlaFormat, latent_dim: int, rope_dim: int, records: list, tail_latent: int,
             tail_rope: int, n_tail: int, q_latent: int, q_rope: int, n_rows: int, n_heads: int,
             row_len: int, scale: float, out: int, lse: int, workspace: int) -> None:
    """Absorbed attention of one sequence (mla.h kvarn_mla_attn): records is
    a list of record addresses (ints), the others data pointers (0: NULL;
    row_len: an int32 array of n_rows, or 0 for all tokens)."""
    arr = (ctypes.c_void_p * max(len(records), 1))(*records)
    check(mla_lib().kvarn_mla_attn(ctypes.byref(fmt), latent_dim, rope_dim, arr, len(records),
                                   tail_latent, tail_rope, n_tail, q_latent, q_rope, n_rows,
                                   n_heads, row_len, scale, out, lse, workspace), "MLA attention")
