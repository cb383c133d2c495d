"""The vLLM attention backend that keeps the KV cache in a kvarn format.

Per layer vLLM allocates [num_blocks, Hk, G, record_bytes / G] uint8 (see
customize_spec): kv_cache[b, h] is one contiguous KVarN tile record
(../shared/spec/KVARN.md "Record layout"). Beside it, per layer, the fp16
staging pool [slots, Hk, 2, G, D] holds sink and tail tiles (staging.py).

A step, for each sequence with q_len new tokens and seq_len L (L0 = L -
q_len tokens of history):
  do_kv_cache_update  rotate the new K/V by H/sqrt(D), store fp16 into the
                      tile's staging slot (or a scratch tile for a whole
                      non-sink tile inside the chunk): kvarn_paged_store.
  forward             history: kvarn_attn_multi_lse over the first L0 tokens
                      (records + fp16 sink/tail), every query sees all of
                      them; the chunk: exact causal attention over its own
                      K/V (../shared/spec/KVARN.md: "Prefill attends to the
                      exact K/V it just computed"); merged by log-sum-exp.
                      Then every tile that became full is committed
                      (kvarn_paged_commit) into its block's record.
"""
import ctypes
import math
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
from .staging import Staging, pool_slots

SINK_TILES = int(os.environ.get("KVARN_SINK_TILES", "1"))


class _State:
    """Process-wide: the layers in order, the staging bookkeeping, the plan
    of the step in flight, the C thread pool and workspaces."""
    layers: list = []
    staging: Staging | None = None
    plan = None
    plan_meta = None
    pool = None
    scratch = {}
    runner = None
    max_num_seqs = 0
    dtype_name = None   # the --kv-cache-dtype, set when the backend is chosen


def is_kvarn_dtype(name) -> bool:
    return isinstance(name, str) and name.startswith("kvarn_")


@dataclass
class KvarnMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True


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
                             slot_mapping=m.slot_mapping,
                             causal=bool(m.causal) if not isinstance(m.causal, torch.Tensor) else True)


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
        return [64, 128, 256]

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return is_kvarn_dtype(kv_cache_dtype)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        name = _State.dtype_name
        return [_lib.parse_format(name).tile_tokens] if is_kvarn_dtype(name) else [128]

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """A page of record bytes: [blocks, Hk, G, record_bytes / G] uint8."""
        from dataclasses import replace
        name = _State.dtype_name
        fmt = _lib.parse_format(name, spec.head_size)
        if spec.block_size != fmt.tile_tokens:
            raise ValueError(
                f"kvarn: --kv-cache-dtype {name} stores tiles of {fmt.tile_tokens} tokens, "
                f"so it needs --block-size {fmt.tile_tokens} (got {spec.block_size})")
        rb = _lib.record_bytes(fmt, spec.head_size)
        return replace(spec, dtype=torch.uint8, state_content_bytes=rb // fmt.tile_tokens)


class KvarnAttentionImpl(AttentionImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                 sliding_window, kv_cache_dtype, logits_soft_cap=None,
                 attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None):
        unsupported = []
        if alibi_slopes is not None: unsupported.append("ALiBi")
        if logits_soft_cap: unsupported.append("logits soft-capping")
        if sinks is not None: unsupported.append("learned attention sinks")
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
        self.layer_index = None
        self.pool_tensor = None
        from vllm.config import get_current_vllm_config
        cfg = get_current_vllm_config()
        _State.max_num_seqs = cfg.scheduler_config.max_num_seqs
        if cfg.cache_config.block_size != self.G:
            raise ValueError(
                f"kvarn: --kv-cache-dtype {kv_cache_dtype} stores tiles of {self.G} tokens, "
                f"so it needs --block-size {self.G} (got {cfg.cache_config.block_size})")

    # ------------------------------------------------------------------ views
    def _view(self, kv_cache: torch.Tensor, pages: torch.Tensor) -> _lib.PagedKV:
        v = _lib.PagedKV()
        v.fmt = self.fmt
        v.head_dim, v.n_kv_heads, v.block_size = self.head_size, self.num_kv_heads, self.G
        v.sink_tiles = SINK_TILES
        v.blocks = kv_cache.data_ptr()
        v.block_stride = kv_cache.stride(0) * kv_cache.element_size()
        v.record_stride = kv_cache.stride(1) * kv_cache.element_size()
        v.token_record_bytes = 0
        v.fp16_pages = pages.data_ptr()
        v.page_stride = pages.stride(0) * 2
        v.page_head_stride = pages.stride(1) * 2
        v.n_blocks = kv_cache.shape[0]
        v.n_fp16_pages = pages.shape[0]
        return v

    def _setup(self, layer, kv_cache: torch.Tensor) -> None:
        name = getattr(layer, "layer_name", id(layer))
        if name not in _State.layers:
            _State.layers.append(name)
        self.layer_index = _State.layers.index(name)
        if _State.staging is None:
            n = pool_slots(_State.max_num_seqs, SINK_TILES)
            _State.staging = Staging(n, self.G, SINK_TILES, kv_cache.shape[0])
            _State.staging.live_blocks = _live_blocks
            L = _lib.lib()
            p = ctypes.c_void_p()
            _lib.check(L.kvarn_thread_pool_create(max(1, torch.get_num_threads()),
                                                  ctypes.byref(p)), "thread pool")
            _State.pool = p
        self.pool_tensor = torch.zeros((_State.staging.n_slots, self.num_kv_heads, 2, self.G,
                                        self.head_size), dtype=torch.int16)

    def _scratch(self, n_tiles: int) -> torch.Tensor:
        key = (self.num_kv_heads, self.head_size)
        t = _State.scratch.get(key)
        if t is None or t.shape[0] < n_tiles:
            t = torch.empty((max(n_tiles, 1), self.num_kv_heads, 2, self.G, self.head_size),
                            dtype=torch.int16)
            _State.scratch[key] = t
        return t

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
        if self.layer_index == 0 or _State.plan_meta is not md:
            _State.plan = _State.staging.plan(md.query_start_loc.cpu().numpy(),
                                              md.seq_lens.cpu().numpy(),
                                              md.block_table.cpu().numpy(), n)
            _State.plan_meta = md
        p = _State.plan
        k = key[:n].reshape(n, self.num_kv_heads, self.head_size).float().contiguous()
        v = value[:n].reshape(n, self.num_kv_heads, self.head_size).float().contiguous()
        L = _lib.lib()
        view = self._view(kv_cache, self.pool_tensor)
        _lib.check(L.kvarn_paged_store(ctypes.byref(view), k.data_ptr(), v.data_ptr(),
                                       p.store_slots.ctypes.data, n), "store")
        if p.n_scratch:
            scr = self._scratch(p.n_scratch)
            sview = self._view(kv_cache, scr)
            _lib.check(L.kvarn_paged_store(ctypes.byref(sview), k.data_ptr(), v.data_ptr(),
                                           p.scratch_slots.ctypes.data, n), "store (scratch)")

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
        p = _State.plan
        n = md.num_actual_tokens
        Hq, Hk, D = self.num_heads, self.num_kv_heads, self.head_size
        q = query[:n].reshape(n, Hq, D).float().contiguous()
        k = key[:n].reshape(n, Hk, D).float()
        v = value[:n].reshape(n, Hk, D).float()
        # full tiles first: the queries of later tiles read their records
        self._commit(kv_cache, p)
        o_hist = torch.zeros((n, Hq, D), dtype=torch.float32)
        lse_hist = torch.full((n, Hq), -math.inf, dtype=torch.float32)
        self._history(kv_cache, p, q, o_hist, lse_hist)
        o_own, lse_own = self._own_tile(kv_cache, p, q, k, v)
        lse = torch.logaddexp(lse_hist, lse_own)
        res = (torch.exp(lse_hist - lse).unsqueeze(-1) * o_hist +
               torch.exp(lse_own - lse).unsqueeze(-1) * o_own)
        output[:n].view(n, Hq, D).copy_(res.to(output.dtype))
        if self.layer_index == len(_State.layers) - 1:
            _State.staging.finish(p)
        return output

    def _hadamard(self) -> torch.Tensor:
        h = _State.scratch.get(("H", self.head_size))
        if h is None:
            h = torch.ones(1, 1)
            while h.shape[0] < self.head_size:
                h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
            h = h / math.sqrt(self.head_size)
            _State.scratch[("H", self.head_size)] = h
        return h

    def _own_tile(self, kv_cache, p, q, k, v):
        """Each query over the tokens of its own tile before it, as fp16
        (rotated) in the tile's slot or scratch page, and over itself
        exactly; in the rotated basis, rotated back (spec: H = H^-1)."""
        n, Hq, D = q.shape
        Hk, g = self.num_kv_heads, self.num_heads // self.num_kv_heads
        H = self._hadamard()
        qr = torch.matmul(q, H)
        kr, vr = torch.matmul(k, H), torch.matmul(v, H)
        out = torch.empty((n, Hq, D), dtype=torch.float32)
        lse = torch.empty((n, Hq), dtype=torch.float32)
        self_s = (qr * kr.repeat_interleave(g, dim=1)).sum(-1) * self.scale      # [n, Hq]
        scr = self._scratch(p.n_scratch) if p.n_scratch else None
        for (i, t, j0, j1, off0, where, page) in p.groups:
            m = j1 - j0
            qg = qr[j0:j1].transpose(0, 1)                                  # [Hq, m, D]
            s_self = self_s[j0:j1].transpose(0, 1).unsqueeze(-1)           # [Hq, m, 1]
            vs = vr[j0:j1].repeat_interleave(g, dim=1).transpose(0, 1)     # [Hq, m, D]
            n_prev = off0 + m - 1                                          # tile tokens before the last query
            if n_prev > 0:
                if where == "record":
                    kp, vp = self._decode_record(kv_cache, page, n_prev)
                else:
                    src = self.pool_tensor if where == "pool" else scr
                    kp = src[page, :, 0, :n_prev].view(torch.float16).float()  # [Hk, n_prev, D]
                    vp = src[page, :, 1, :n_prev].view(torch.float16).float()
                kp, vp = kp.repeat_interleave(g, 0), vp.repeat_interleave(g, 0)
                sp = torch.matmul(qg, kp.transpose(1, 2)) * self.scale     # [Hq, m, n_prev]
                lim = torch.arange(off0, off0 + m).unsqueeze(1)            # query offsets
                sp = sp.masked_fill(torch.arange(n_prev).unsqueeze(0) >= lim, -math.inf)
                sc = torch.cat([sp, s_self], -1)
                l = torch.logsumexp(sc, -1)
                w = torch.exp(sc - l.unsqueeze(-1))
                o = torch.matmul(w[..., :-1], vp) + w[..., -1:] * vs
            else:
                l = s_self.squeeze(-1)
                o = vs
            out[j0:j1] = torch.matmul(o, H).transpose(0, 1)
            lse[j0:j1] = l.transpose(0, 1)
        return out, lse

    def _decode_record(self, kv_cache, block: int, n_prev: int):
        """K/V (rotated basis) of the first n_prev tokens of a committed
        block: vLLM recomputing a token of a cached, full block (a whole
        prompt hit) finds no fp16 copy; the record stands in for it."""
        L = _lib.lib()
        G, D, Hk = self.G, self.head_size, self.num_kv_heads
        kp = torch.empty((Hk, G, D), dtype=torch.float32)
        vp = torch.empty((Hk, G, D), dtype=torch.float32)
        for h in range(Hk):
            rec = kv_cache[block, h]
            _lib.check(L.kvarn_decode(ctypes.byref(self.fmt), D, rec.data_ptr(), rec.numel(),
                                      kp[h].data_ptr(), vp[h].data_ptr(), 1), "decode")
        return kp[:, :n_prev], vp[:, :n_prev]

    def _history(self, kv_cache, p, q, o_hist, lse_hist) -> None:
        """Each query group of tile t over tiles [0, t): records, sink tiles
        in fp16, through the fused kernels (non-causal: all of it)."""
        L = _lib.lib()
        for has_sink in (True, False):
            groups = [gr for gr in p.groups if gr[1] > 0 and bool(p.has_sink[gr[0]]) == has_sink]
            if not groups:
                continue
            view = self._view(kv_cache, self.pool_tensor)
            if not has_sink:
                view.sink_tiles = 0
            sub_qsl = np.zeros(len(groups) + 1, dtype=np.int32)
            sub_qsl[1:] = np.cumsum([gr[3] - gr[2] for gr in groups])
            qsel = torch.cat([q[gr[2]:gr[3]] for gr in groups]).contiguous()
            osel = torch.empty_like(qsel)
            lsel = torch.empty((qsel.shape[0], self.num_heads), dtype=torch.float32)
            seqs = (_lib.SeqView * len(groups))()
            for j, (i, t, *_rest) in enumerate(groups):
                seqs[j].block_table = p.tables[i].ctypes.data
                seqs[j].seq_len = t * self.G
                seqs[j].committed_tiles = t
            opts = _lib.AttnOpts(self.scale, self.sliding_window, 0, None)
            nthr = L.kvarn_thread_pool_size(_State.pool)
            ws_bytes = L.kvarn_attn_workspace_bytes(ctypes.byref(view), self.num_heads, len(groups),
                                                    int(qsel.shape[0]), nthr, ctypes.byref(opts))
            if ws_bytes == 0:
                raise _lib.KvarnError("kvarn: attention workspace size refused")
            ws = _State.scratch.get("ws")
            if ws is None or ws.numel() < ws_bytes:
                ws = torch.empty(ws_bytes, dtype=torch.uint8)
                _State.scratch["ws"] = ws
            _lib.check(L.kvarn_attn_multi_lse(ctypes.byref(view), ctypes.addressof(seqs),
                                              len(groups), sub_qsl.ctypes.data, self.num_heads,
                                              qsel.data_ptr(), osel.data_ptr(), lsel.data_ptr(),
                                              ctypes.byref(opts), _State.pool, ws.data_ptr(),
                                              ws.numel()), "attention")
            off = 0
            for gr in groups:
                m = gr[3] - gr[2]
                o_hist[gr[2]:gr[3]] = osel[off:off + m]
                lse_hist[gr[2]:gr[3]] = lsel[off:off + m]
                off += m

    def _commit(self, kv_cache, p) -> None:
        L = _lib.lib()
        for pairs, pages in ((p.commit_pool, self.pool_tensor),
                             (p.commit_scratch, self._scratch(p.n_scratch) if p.n_scratch else None)):
            if not pairs:
                continue
            view = self._view(kv_cache, pages)
            src = np.array([s for s, _ in pairs], dtype=np.int32)
            dst = np.array([b for _, b in pairs], dtype=np.int32)
            ws_bytes = L.kvarn_paged_commit_workspace_bytes(ctypes.byref(view))
            ws = torch.empty(ws_bytes, dtype=torch.uint8)
            _lib.check(L.kvarn_paged_commit(ctypes.byref(view), src.ctypes.data, dst.ctypes.data,
                                            len(pairs), None, ws.data_ptr(), ws_bytes), "commit")


def _live_blocks() -> set:
    """Block ids held by the requests in vLLM's persistent batch (running,
    scheduled this step or not)."""
    r = _State.runner
    if r is None:
        return set()
    try:
        ib = r.input_batch
        bt = ib.block_table[0]
        n = ib.num_reqs
        arr = bt.block_table.np[:n]
        cnt = bt.num_blocks_per_row[:n]
        out = set()
        for i in range(n):
            out.update(int(x) for x in arr[i, : int(cnt[i])])
        return out
    except AttributeError:
        return set()
