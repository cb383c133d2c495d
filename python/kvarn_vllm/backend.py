"""The vLLM attention backend that keeps the KV cache in a kvarn format.

Per layer vLLM allocates [num_blocks, Hk, G, record_bytes / G] uint8 (see
customize_spec): kv_cache[b, h] is one contiguous KVarN tile record
(../shared/spec/KVARN.md "Record layout"). Beside it the staging pool holds
sink and tail tiles (slots, per layer) and a step's whole tiles (scratch,
shared by the layers) until they are committed (staging.py): one tensor
[layers * slots + scratch, Hk, page] of fp16 rows [2, G, D] or token
records [G, record] of the staging's per-token format (int8, fp8_e4m3,
int4; KVARN_STAGING, settings.py).

A step, for each sequence with q_len new tokens:
  do_kv_cache_update  rotate the new K/V by H/sqrt(D), store fp16 into the
                      tile's staging slot (fp16 or a token record), or for a whole non-sink tile
                      inside the chunk a scratch page of the same arena
                      (kvarn_paged_store); then every tile whose G tokens
                      are all known tokens of this chunk (a prefill chunk's
                      whole tile) is committed into its block's record
                      straight from these exact K/V (kvarn_paged_commit_exact;
                      KVARN_PREFILL_COMMIT, settings.py), not
                      rounded by the staging first.
  forward             commit every other tile that became full
                      (kvarn_paged_commit of its staged page into its
                      block's record), then one causal
                      kvarn_attn_multi call: each group of queries of tile t
                      sees tiles < t as the cache holds them (records, fp16
                      sink) and its own tile in fp16 up to itself, what the
                      token would see decoded one at a time (docs/vllm.md
                      "A step").
The calls go through ops.py: the CPU kernels for CPU tensors, the CUDA
kernels (libkvarn_cuda.so) for CUDA tensors, same pages, same plan.

Per-token formats (kvarn_int8, kvarn_int4, kvarn_fp8_e4m3, kvarn_fp8_e5m2;
_lib.PER_TOKEN_DTYPES): the page is [num_blocks, Hk, block_size,
record_bytes] uint8, block_size any multiple of 16 (vLLM's); each new
token's record is encoded straight into its slot (slot_mapping,
kvarn_paged_store) and one causal kvarn_attn_multi call per layer reads
every token from its record, its own included. No staging pool, no plan,
no commit: a slot vLLM writes again (a rejected draft's, a recomputed
token's) is simply overwritten (docs/vllm.md "Per-token formats").
"""
import os
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from vllm.v1.attention.backend import (AttentionBackend, AttentionImpl,
                                       AttentionMetadataBuilder, AttentionType,
                                       CommonAttentionMetadata)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from . import _lib
from .ops import make_ops
from .settings import Settings
from .spec import check_speculative, draft_tokens
from .commit_log import _commit_log_path, _log_commits
from .staging import Staging, pool_size
from .state import _State, _live_blocks, apply_loaded, step_draft_counts


is_kvarn_dtype = _lib.is_kvarn_dtype


@dataclass
class KvarnMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_draft: np.ndarray | None = None   # int32 [num_reqs] or None (no speculation)


def _token_step(md: KvarnMetadata):
    """A per-token step's attention arguments, (qsl, lens, tables, zeros,
    m, seqs): query_start_loc from 0, seq_lens, block tables (int32
    numpy), m the requests' query rows (num_actual_tokens, unless vLLM
    padded the batch) and the kvarn_seq_view array (ops.seq_views); None
    for a step without requests. Made by the step's first layer and kept
    on its metadata for the others (they all read the same one)."""
    step = md.__dict__.get("_kvarn_token_step")
    if step is None:
        qsl = np.ascontiguousarray(md.query_start_loc.cpu().numpy(), dtype=np.int32)
        qsl = qsl - qsl[0]
        lens = np.ascontiguousarray(md.seq_lens.cpu().numpy(), dtype=np.int32)
        ns = len(lens)
        if ns == 0:
            step = ()
        else:
            tables = np.ascontiguousarray(md.block_table.cpu().numpy(), dtype=np.int32)
            zeros = np.zeros(ns, dtype=np.int32)
            step = (qsl, lens, tables, zeros, int(qsl[-1]),
                    _State.ops.seq_views(tables, lens, zeros, zeros))
        md._kvarn_token_step = step
    return step or None


class KvarnMetadataBuilder(AttentionMetadataBuilder[KvarnMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KvarnMetadata:
        m = common_attn_metadata
        return KvarnMetadata(num_actual_tokens=m.num_actual_tokens,
                             max_query_len=m.max_query_len,
                             query_start_loc=m.query_start_loc[: m.num_reqs + 1],
                             seq_lens=m.seq_lens[: m.num_reqs],
                             block_table=m.block_table_tensor[: m.num_reqs],
                             num_draft=step_draft_counts(m.num_reqs, m.query_start_loc_cpu))


class KvarnAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16,
                                                     torch.float16]

    @staticmethod
    def get_name() -> str:
        return "KVARN"

    @staticmethod
    def get_impl_cls():
        return KvarnAttentionImpl

    @staticmethod
    def get_builder_cls():
        return KvarnMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [64, 128, 256, 512]

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return is_kvarn_dtype(kv_cache_dtype)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        name = _State.dtype_name
        if _lib.is_per_token_dtype(name):
            from vllm.v1.attention.backend import MultipleOf
            return [MultipleOf(PER_TOKEN_BLOCK)]
        return [_lib.parse_format(name).tile_tokens] if is_kvarn_dtype(name) else [128]

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """A page of record bytes: [blocks, Hk, G, record_bytes / G] uint8.
        Where the kvarn layers mix sliding-window and full ones (gpt-oss,
        Gemma-2 with KVARN_SLIDING_WINDOW=quantize), the sliding ones get
        vLLM's FullAttentionSpec with their window recorded (as vLLM does
        without its hybrid allocator): one KV-cache group, one block table
        and one staging plan a step for every kvarn layer, the window
        applied by the kernels (two groups' block tables would each get a
        plan of their own a step, and the staging bookkeeping is one)."""
        from dataclasses import fields, replace
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
        if isinstance(spec, SlidingWindowSpec) and 0 < _State.n_sliding < _State.n_impls:
            full = {f.name for f in fields(FullAttentionSpec) if f.init}
            spec = FullAttentionSpec(**{f.name: getattr(spec, f.name) for f in fields(spec)
                                        if f.init and f.name in full})
        name = _State.dtype_name
        fmt = _lib.parse_format(name, spec.head_size)
        if not fmt.per_tile:
            # per-token records: [blocks, Hk, block_size, record_bytes]
            check_per_token_block(name, spec.block_size, allow_one=True)
            return replace(spec, dtype=torch.uint8,
                           state_content_bytes=_lib.record_bytes(fmt, spec.head_size))
        # block_size 1: vLLM asking for the bytes of one token (sliding-window
        # specs, page alignment), not a block the cache will have; a multiple
        # of the tile: a manager block that vLLM raised itself to cover a
        # Mamba-type layer's page (hybrid linear attention, Qwen3-Next), split
        # into kernel blocks of one tile (get_supported_kernel_block_sizes)
        if spec.block_size not in (1, fmt.tile_tokens) and not _raised_for_state(
                spec.block_size, fmt.tile_tokens):
            raise ValueError(
                f"kvarn: --kv-cache-dtype {name} stores tiles of {fmt.tile_tokens} tokens, "
                f"so it needs --block-size {fmt.tile_tokens} (got {spec.block_size})")
        rb = _lib.record_bytes(fmt, spec.head_size)
        return replace(spec, dtype=torch.uint8, state_content_bytes=rb // fmt.tile_tokens)


PER_TOKEN_BLOCK = 16   # a per-token format's block: any multiple of this (vLLM's CPU build: 16+)


def check_per_token_block(name: str, block_size: int, allow_one: bool = False) -> None:
    """ValueError unless block_size (tokens) is a multiple of
    PER_TOKEN_BLOCK (or 1 with allow_one: vLLM asking for one token's
    bytes)."""
    if (allow_one and block_size == 1) or (block_size > 0 and
                                           block_size % PER_TOKEN_BLOCK == 0):
        return
    raise ValueError(f"kvarn: --kv-cache-dtype {name} (per-token records) needs a "
                     f"--block-size that is a multiple of {PER_TOKEN_BLOCK} (got {block_size})")


def _raised_for_state(block_size: int, tile_tokens: int) -> bool:
    """Whether block_size (tokens) is a manager block that vLLM 0.32 raised
    itself for a hybrid model (Mamba-type layers such as Qwen3-Next's Gated
    DeltaNet: the attention page must cover a layer's state page): a
    multiple of the tile on a model vLLM calls hybrid (recorded by the
    layers' KvarnAttentionImpl, built before vLLM asks for their specs), or
    the manager block layout.align_pages set where kvarn layers share the
    pool with sliding-window layers in vLLM's own cache. A --block-size
    other than the tile on any other model stays refused."""
    return block_size % tile_tokens == 0 and (_State.hybrid
                                              or block_size == _State.aligned_block)


class KvarnAttentionImpl(AttentionImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                 sliding_window, kv_cache_dtype, logits_soft_cap=None,
                 attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None):
        unsupported = []
        if alibi_slopes is not None: unsupported.append("ALiBi")
        if logits_soft_cap: unsupported.append("logits soft-capping")
        if kv_sharing_target_layer_name: unsupported.append("KV sharing between layers")
        if attn_type != AttentionType.DECODER: unsupported.append(f"attention type {attn_type}")
        if unsupported:
            raise NotImplementedError("kvarn backend: not supported: " + ", ".join(unsupported))
        self.fmt = _lib.parse_format(kv_cache_dtype, head_size)
        _State.dtype_name = kv_cache_dtype
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.sliding_window = 0 if sliding_window is None else int(sliding_window)
        self.G = self.fmt.tile_tokens
        self.per_token = not self.fmt.per_tile
        from vllm.config import get_current_vllm_config
        cfg = get_current_vllm_config()
        self.settings = Settings.of(cfg)
        # per-token formats have no sink tiles (paged.h): every token is a
        # record from its store on
        self.sink_tiles, self.sink_partial = (0, 0) if self.per_token else \
            self.settings.sink(self.G)
        self.sinks = None
        # learned sink logits (gpt-oss), one per query head: the model's
        # parameter, loaded after this; read at each step (attn.h
        # kvarn_attn_opts.sinks)
        self.sink_param = sinks
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise NotImplementedError(
                f"kvarn backend: learned sinks of shape {tuple(sinks.shape)}, not one per "
                f"query head ({num_heads})")
        self.layer_index = None
        self.pool_tensor = None
        _State.n_impls += 1
        _State.n_sliding += 1 if self.sliding_window > 0 else 0
        _State.hybrid = bool(cfg.model_config is not None and cfg.model_config.is_hybrid)
        _State.max_num_seqs = cfg.scheduler_config.max_num_seqs
        _State.max_batched_tokens = cfg.scheduler_config.max_num_batched_tokens
        _State.draft_tokens = draft_tokens(cfg)
        check_speculative(cfg)
        if self.per_token:
            check_per_token_block(kv_cache_dtype, cfg.cache_config.block_size)
        elif cfg.cache_config.block_size != self.G and not _raised_for_state(
                cfg.cache_config.block_size, self.G):
            raise ValueError(
                f"kvarn: --kv-cache-dtype {kv_cache_dtype} stores tiles of {self.G} tokens, "
                f"so it needs --block-size {self.G} (got {cfg.cache_config.block_size})")

    # ------------------------------------------------------------------ views
    def _token_view(self, kv_cache: torch.Tensor) -> _lib.PagedKV:
        """A per-token format's view of the layer's cache tensor [blocks,
        Hk, N, record_bytes] (uint8; N = vLLM's kernel block): block b,
        KV head h, token j at blocks + b * stride(0) + h * stride(1) + j *
        stride(2) (paged.h kvarn_paged_token_record); no pages. Kept for
        the tensor it was made of (the layer's cache is allocated once)."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.stride())
        cached = self.__dict__.get("_tview")
        if cached is not None and cached[0] == key:
            return cached[1]
        v = _lib.PagedKV()
        v.fmt = self.fmt
        v.head_dim, v.n_kv_heads = self.head_size, self.num_kv_heads
        v.block_size = int(kv_cache.shape[2])
        v.sink_tiles = 0
        es = kv_cache.element_size()
        v.blocks = kv_cache.data_ptr()
        v.block_stride = kv_cache.stride(0) * es
        v.record_stride = kv_cache.stride(1) * es
        v.token_record_bytes = kv_cache.stride(2) * es
        v.n_blocks = kv_cache.shape[0]
        v.staging = _lib.STAGING_FP16   # read for KVarN only; per-token views take 0
        self._tview = (key, v)
        return v

    def _view(self, kv_cache: torch.Tensor, pages: torch.Tensor,
              has_sink: bool = True) -> _lib.PagedKV:
        """The KVarN layer's view: its records (kv_cache), the staging
        pool's pages and the fp16 sinks; has_sink False: the same without
        sink tiles (for the groups whose sequence has none yet). Kept per
        has_sink for the tensors it was made of, so callers read it and
        never change it."""
        sk = self.sinks if self.sink_partial > 0 else None
        key = (kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(), pages.data_ptr(),
               pages.shape, pages.stride(), _State.staging_kind,
               None if sk is None else (sk.data_ptr(), sk.shape, sk.stride()))
        cache = self.__dict__.setdefault("_views", {})
        cached = cache.get(has_sink)
        if cached is not None and cached[0] == key:
            return cached[1]
        v = _lib.PagedKV()
        v.fmt = self.fmt
        v.head_dim, v.n_kv_heads, v.block_size = self.head_size, self.num_kv_heads, self.G
        v.sink_tiles = self.sink_tiles
        if self.sink_partial > 0:
            sk = self.sinks
            v.sink_partial = self.sink_partial
            v.fp16_sinks = sk.data_ptr()
            v.sink_stride = sk.stride(0) * sk.element_size()
            v.sink_head_stride = sk.stride(1) * sk.element_size()
            v.n_sink_slots = sk.shape[0]
        v.blocks = kv_cache.data_ptr()
        v.block_stride = kv_cache.stride(0) * kv_cache.element_size()
        v.record_stride = kv_cache.stride(1) * kv_cache.element_size()
        v.token_record_bytes = 0
        v.fp16_pages = pages.data_ptr()
        v.page_stride = pages.stride(0) * pages.element_size()
        v.page_head_stride = pages.stride(1) * pages.element_size()
        v.n_blocks = kv_cache.shape[0]
        v.n_fp16_pages = pages.shape[0]
        v.staging = _State.staging_kind
        v.staging_record_bytes = _State.pool_size["record_bytes"]
        if not has_sink:
            v.sink_tiles = 0
            v.sink_partial = 0
        cache[has_sink] = (key, v)
        return v

    def _page_shape(self, tokens: int = 0) -> tuple:
        """One staging page (tokens = G) or sink slot (tokens = r) of one
        layer: fp16 [Hk, 2, tokens, D] (int16 storage) or staged token
        records [Hk, tokens, record_bytes] (uint8; int8, fp8_e4m3 or int4)."""
        t = tokens or self.G
        if _State.staging_kind != _lib.STAGING_FP16:
            return (self.num_kv_heads, t, _State.pool_size["record_bytes"])
        return (self.num_kv_heads, 2, t, self.head_size)

    def _page_dtype(self):
        return torch.uint8 if _State.staging_kind != _lib.STAGING_FP16 else torch.int16

    def _setup_per_token(self, kv_cache: torch.Tensor) -> None:
        """A per-token layer: the ops and the view's check; no pool."""
        if kv_cache.device.type != "cpu" or os.environ.get("KVARN_TEST_CUDA_EMULATOR"):
            raise _lib.KvarnError(
                f"kvarn: {_State.dtype_name} (per-token records) is served by the CPU "
                f"kernels only; on {kv_cache.device} use a kvarn_k*v*_g* format")
        if kv_cache.dim() != 4 or kv_cache.stride(3) != 1 or \
                kv_cache.stride(2) < _lib.record_bytes(self.fmt, self.head_size):
            raise _lib.KvarnError(
                f"kvarn: the cache tensor of a {_State.dtype_name} layer has shape "
                f"{tuple(kv_cache.shape)} and strides {kv_cache.stride()}, not [blocks, Hk, "
                f"tokens, record bytes] with records back to back")
        if _State.ops is None:
            _State.ops = make_ops(kv_cache.device)
            from vllm.logger import init_logger
            ki = _lib.attn_kernel_info(self.fmt, self.head_size, 0)
            mat = f", items of {ki['matrix_rows']}+ rows on {ki['matrix']}" if ki["matrix"] else ""
            init_logger("vllm.kvarn_vllm").info(
                "kvarn: cpu kernels (attention %s%s), cache %s per-token records of %d bytes "
                "per token and KV head, blocks of %d tokens; no staging pool",
                ki["level"], mat, self.fmt.name.decode(), int(kv_cache.stride(2)),
                int(kv_cache.shape[2]))
        self.pool_tensor = kv_cache   # marks the layer set up
        _State.ops.check(self._token_view(kv_cache))

    def _setup(self, layer, kv_cache: torch.Tensor) -> None:
        name = getattr(layer, "layer_name", id(layer))
        if name not in _State.layers:
            _State.layers.append(name)
        self.layer_index = _State.layers.index(name)
        _State.kv_caches[name] = kv_cache
        if self.per_token:
            self._setup_per_token(kv_cache)
            return
        if _State.staging is None:
            _State.staging_kind = self.settings.staging_kind(kv_cache.device.type)
            _State.exact_commit = self.settings.exact_commit(kv_cache.device.type)
            ps = _State.pool_size
            if ps is None or ps["staging"] != _State.staging_kind:
                # no budget hook ran (a caller building the layers itself):
                # the unbounded sizes
                ps = pool_size(self.fmt, 1, self.num_kv_heads, self.head_size,
                               _State.max_num_seqs, self.sink_tiles, self.sink_partial,
                               _State.draft_tokens, _State.staging_kind,
                               _State.max_batched_tokens)
                _State.pool_size = ps
            _State.staging = Staging(ps["n_slots"], self.G, self.sink_tiles, kv_cache.shape[0],
                                     ps["n_scratch"], self.sink_partial, ps["n_sink_slots"])
            _State.staging.live_blocks = _live_blocks
            _State.ops = make_ops(kv_cache.device)
            # the emulated CUDA path (KVARN_TEST_CUDA_EMULATOR) on a CPU
            # tensor: CudaOps, which has no exact commit
            _State.exact_commit = _State.exact_commit and _State.ops.exact_commit
            _State.pool_layers = L = max(1, _State.n_impls)
            _State.pool = torch.zeros((L * ps["n_slots"] + ps["n_scratch"],) +
                                      self._page_shape(), dtype=self._page_dtype(),
                                      device=kv_cache.device)
            from vllm.logger import init_logger
            kern = ""
            if kv_cache.device.type == "cpu":
                # the C attention's SIMD level, and the matrix kernel that
                # work items of 16+ query rows take (prefill, verification)
                ki = _lib.attn_kernel_info(self.fmt, self.head_size, _State.staging_kind)
                kern = f" (attention {ki['level']}, items of {ki['matrix_rows']}+ rows on " \
                       f"{ki['matrix']})" if ki["matrix"] else f" (attention {ki['level']})"
            init_logger("vllm.kvarn_vllm").info(
                "kvarn: %s kernels on %s%s, cache %s, staging %s: %d slots, %d sink slots, "
                "%d scratch tiles; prefill tiles committed from the %s K/V", _State.ops.name,
                kv_cache.device, kern, self.fmt.name.decode(),
                _lib.staging_name(_State.staging_kind), ps["n_slots"], ps["n_sink_slots"],
                ps["n_scratch"], "exact" if _State.exact_commit else "staged")
        st, L = _State.staging, _State.pool_layers
        if self.layer_index >= L:
            raise _lib.KvarnError(
                f"kvarn: layer {self.layer_index} has no staging pages (the pool was sized "
                f"for {L} kvarn layers)")
        # this layer's slots, then (ids from n_slots on, shifted by
        # scratch_shift) the shared scratch
        self.pool_tensor = _State.pool[self.layer_index * st.n_slots:]
        self.scratch_shift = (L - 1 - self.layer_index) * st.n_slots
        if self.sink_partial > 0:
            self.sinks = torch.zeros((st.n_sink_slots,) + self._page_shape(self.sink_partial),
                                     dtype=self._page_dtype(), device=kv_cache.device)
        _State.ops.check(self._view(kv_cache, self.pool_tensor))

    # ------------------------------------------------------------------ store
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        from vllm.forward_context import get_forward_context
        md = get_forward_context().attn_metadata
        if isinstance(md, dict):
            md = md.get(layer.layer_name)
        if md is None:
            return
        if self.pool_tensor is None:
            self._setup(layer, kv_cache)
        n = md.num_actual_tokens
        if self.per_token:
            # each token's record straight into its slot (a slot written
            # before, a rejected draft's, is overwritten); the slots
            # converted once a step (every layer gets the same mapping)
            c = md.__dict__.get("_kvarn_slots")
            if c is None or c[0] is not slot_mapping or c[1] != n:
                c = (slot_mapping, n,
                     np.ascontiguousarray(slot_mapping[:n].cpu().numpy(), dtype=np.int64))
                md._kvarn_slots = c
            slots = c[2]
            _State.ops.store(self._token_view(kv_cache), key, value, slots, n,
                             self.num_kv_heads, self.head_size)
            return
        if self.layer_index == 0 or _State.plan_meta is not md:
            # blocks a KV connector loaded since the last step (offload.py)
            apply_loaded()
            _State.plan = _State.staging.plan(md.query_start_loc.cpu().numpy(),
                                              md.seq_lens.cpu().numpy(),
                                              md.block_table.cpu().numpy(), n,
                                              md.num_draft)
            _State.plan_meta = md
        p = _State.plan
        ids = self._ids(p)
        _State.ops.store(self._view(kv_cache, self.pool_tensor), key, value,
                         ids["store_slots"], n, self.num_kv_heads, self.head_size,
                         exact=ids["exact"])

    # ------------------------------------------------------------------ attend
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvarn backend: fused output quantization")
        md = attn_metadata
        if md is None:
            return output
        if self.pool_tensor is None:
            self._setup(layer, kv_cache)
        if self.per_token:
            return self._forward_per_token(query, kv_cache, md, output)
        p = _State.plan
        n = md.num_actual_tokens
        q, out, res = self._io(query, output, n)
        # full tiles first: the queries of later tiles read their records
        self._commit(kv_cache, p)
        self._attend(kv_cache, p, q, res)
        for page, slot in self._ids(p)["handoffs"]:
            # the tile started in scratch this step moves into the slot of
            # the tile it followed, read for the last time just now
            # (staging.py _hand_over)
            self.pool_tensor[slot].copy_(self.pool_tensor[page])
        if res is not out:
            out.copy_(res)  # converts to the model's dtype
        if self.layer_index == len(_State.layers) - 1:
            # the last layer so far: in the first step the layers register as
            # they run (_setup), so each one is the last when it runs; the
            # plan is finished once, the log written once every layer is in
            if not p.finished:
                _State.staging.finish(p)
                p.finished = True
            if (_commit_log_path() and len(_State.layers) == _State.pool_layers
                    and os.path.exists(_commit_log_path() + ".go")):
                _log_commits(p)
        return output

    def _forward_per_token(self, query, kv_cache, md, output):
        """One causal kvarn_attn_multi call over the per-token records: the
        queries of request i are its last q_len positions, each seeing the
        records of positions <= itself (its own stored just before)."""
        if md.num_actual_tokens == 0:
            return output
        step = _token_step(md)
        if step is None:
            return output
        qsl, lens, tables, zeros, m, seqs = step
        q, out, res = self._io(query, output, m)
        _State.ops.attend(self._token_view(kv_cache), tables, lens, zeros, zeros, qsl, q, res,
                          self.num_heads, self.scale, self.sliding_window, self._sink_logits(),
                          seqs=seqs)
        if res is not out:
            out.copy_(res)   # converts to the model's dtype
        return output

    def _io(self, query, output, n):
        """attend's q and result buffer for the first n tokens, and the
        output view [n, Hq, D] they end in. Their dtype: the model's where
        the ops read and write it themselves (CpuOps: bf16) and query and
        output share it, else fp32 (the result then copied, exactly or
        rounded, into out). The result buffer is out itself where it can
        be: the kernels then write the model's tensor directly."""
        Hq, D = self.num_heads, self.head_size
        io = (query.dtype if query.dtype == output.dtype and query.dtype in _State.ops.io_dtypes
              else torch.float32)
        q = query[:n].reshape(n, Hq, D).to(io).contiguous()
        out = output[:n].view(n, Hq, D)
        res = (out if out.dtype == io and out.is_contiguous()
               else torch.empty((n, Hq, D), dtype=io, device=q.device))
        return q, out, res

    def _attend(self, kv_cache, p, q, res) -> None:
        """Every query group through the fused kernels, causal: records for
        tiles [sink, t), fp16 sink tiles, and its own tile t in fp16 up to
        and including the query (docs/vllm.md "A step")."""
        ng = len(p.groups)
        if ng == 0:
            return
        sinks = self._sink_logits()
        ids = self._ids(p)
        calls = ids.get("attend")
        if calls is None:
            # this step's arguments of the groups with (and without) a sink,
            # made by the first layer and kept with the plan's ids
            calls = []
            for has_sink in ((True,) if p.g_sink.all() else (True, False)):
                sel = np.nonzero(p.g_sink == has_sink)[0]
                if len(sel) == 0:
                    continue
                rows = [(p.groups[j][2], p.groups[j][3]) for j in sel]
                if len(sel) == ng:
                    qsl = (p.g_qsl - p.g_qsl[0]).astype(np.int32)
                else:
                    qsl = np.zeros(len(sel) + 1, dtype=np.int32)
                    qsl[1:] = np.cumsum([b - a for a, b in rows])
                tables = np.ascontiguousarray(ids["g_tables"][sel])
                lens, comm, sslot = (np.ascontiguousarray(x[sel]) for x in
                                     (p.g_len, p.g_committed, p.g_sink_slot))
                calls.append((has_sink, len(sel), rows, qsl, tables, lens, comm, sslot,
                              _State.ops.seq_views(tables, lens, comm, sslot)))
            ids["attend"] = calls
        for has_sink, n_sel, rows, qsl, tables, lens, comm, sslot, seqs in calls:
            view = self._view(kv_cache, self.pool_tensor, has_sink)
            whole = n_sel == ng
            if whole:
                qsel, osel = q, res
            else:
                qsel = torch.cat([q[a:b] for a, b in rows]).contiguous()
                osel = torch.empty_like(qsel)
            _State.ops.attend(view, tables, lens, comm, sslot, qsl, qsel, osel,
                              self.num_heads, self.scale, self.sliding_window, sinks,
                              seqs=seqs)
            if not whole:
                off = 0
                for a, b in rows:
                    res[a:b] = osel[off:off + b - a]
                    off += b - a

    def _sink_logits(self):
        """The layer's learned sink logits as fp32 [Hq], None without: taken
        and checked at the first step (vLLM loads the weights before its
        first forward pass, the profiling run), kept; NaN or +Inf refused
        (the CPU library refuses them too; the CUDA kernels do not look)."""
        if self.sink_param is None:
            return None
        if getattr(self, "_sinks32", None) is None:
            s = self.sink_param.detach().to(torch.float32).contiguous()
            if bool(torch.isnan(s).any()) or bool(torch.isposinf(s).any()):
                raise _lib.KvarnError("kvarn: a learned sink logit is NaN or +Inf")
            self._sinks32 = s
        return self._sinks32

    def _ids(self, p) -> dict:
        """The plan's page ids as this layer's view numbers them: its slots
        are pages [0, n_slots), the shared scratch tile k is page n_slots +
        k + scratch_shift (module docstring; the plan numbers it n_slots + k,
        the last layer's view). Cached on the plan per shift (one entry for
        every layer when the step has no scratch tile: no page to shift)."""
        d = self.scratch_shift if p.n_scratch else 0
        cache = p.__dict__.setdefault("_ids_by_shift", {})
        if d in cache:
            return cache[d]
        ns = _State.staging.n_slots
        slots = p.store_slots
        tables = p.g_tables
        if d:
            slots = slots.copy()
            slots[slots >= ns * self.G] += d * self.G
            tables = tables.copy()
            j, t = p.g_scratch
            tables[j, t] += d
        shift = (lambda page: page + d if page >= ns else page)
        # a prefill chunk's whole tiles from the exact K/V (at the store),
        # the others from their staged page (at the commit)
        rows = np.array(p.commit_rows, dtype=np.int32)
        direct = (rows >= 0) if _State.exact_commit else np.zeros(len(rows), dtype=bool)
        pool = [e for e, x in zip(p.commit_pool, direct) if not x]
        ids = {"store_slots": slots, "g_tables": tables,
               "commit_src": np.array([shift(s) for s, _ in pool], dtype=np.int32),
               "commit_dst": np.array([b for _, b in pool], dtype=np.int32),
               "exact": (np.ascontiguousarray(rows[direct]),
                         np.array([b for (_, b), x in zip(p.commit_pool, direct) if x],
                                  dtype=np.int32)) if direct.any() else None,
               "sink_copies": [(shift(page), slot) for page, slot in p.sink_copies],
               "handoffs": [(shift(page), slot) for page, slot in p.handoffs]}
        cache[d] = ids
        return ids

    def _commit(self, kv_cache, p) -> None:
        """The sink copies, then every tile that filled this step and was
        not committed from the exact K/V at the store, from its staged
        page."""
        if not p.commit_pool:
            return
        ids = self._ids(p)
        r = self.sink_partial
        for page, slot in ids["sink_copies"]:
            # the sink's first r staged tokens (rotated K and V: fp16 rows
            # or token records), kept beside the record the commit is about
            # to write (paged.h)
            if _State.staging_kind != _lib.STAGING_FP16:
                self.sinks[slot] = self.pool_tensor[page, :, :r, :]
            else:
                self.sinks[slot] = self.pool_tensor[page, :, :, :r, :]
        if len(ids["commit_src"]):
            _State.ops.commit(self._view(kv_cache, self.pool_tensor), ids["commit_src"],
                              ids["commit_dst"])
