"""The three things the backend asks of kvarn each step -- store new K/V,
commit full tiles, attend -- once per device kind, on the same pages:

  CpuOps   libkvarn.so: kvarn_paged_store / kvarn_paged_commit /
           kvarn_paged_commit_exact / kvarn_attn_multi
           (include/kvarn/paged_ops.h, attn.h), the C thread pool, fp32
           activations.
  CudaOps  libkvarn_cuda.so: kvarn_cuda_store / kvarn_cuda_commit /
           kvarn_cuda_attention (include/kvarn/cuda.h) on the tensors'
           device and torch's current stream; fp16/bf16 activations.

Both take the same kvarn_paged_kv view (paged.h) of vLLM's per-layer cache
tensor and the staging pool, and the same per-group arrays from the
step's plan (staging.py): one attention entry per (sequence, tile) group of
queries, its block table row, seq_len, committed tiles and query range.
"""
import ctypes
import os

import numpy as np
import torch

from . import _lib


class CpuOps:
    """The CPU kernels (the path the tests run end to end)."""
    name = "cpu"
    exact_commit = True   # store(..., exact=) commits whole tiles from the exact K/V
    # attend's q/out dtypes: bf16 read and written by the C call itself
    # (kvarn_attn_opts.io_bf16), no fp32 copies around it;
    # KVARN_ATTN_IO=fp32 keeps fp32 with torch's conversions around the
    # call (the same numbers: tests/vllm/test_serve.py checks it)
    io_dtypes = ((torch.float32,) if os.environ.get("KVARN_ATTN_IO", "") == "fp32"
                 else (torch.float32, torch.bfloat16))

    def __init__(self, device):
        L = _lib.lib()
        p = ctypes.c_void_p()
        n_thr = int(os.environ.get("KVARN_ATTN_THREADS", "0")) or torch.get_num_threads()
        _lib.check(L.kvarn_thread_pool_create(max(1, n_thr), ctypes.byref(p)), "thread pool")
        self.pool = p
        self.ws = None
        self.cws = None
        self.kv32 = None     # store's fp32 K/V, grown to the largest step

    def check(self, view) -> None:
        _lib.check(_lib.lib().kvarn_paged_check(ctypes.byref(view)), "page layout check")

    def store(self, view, key, value, slots: np.ndarray, n: int, Hk: int, D: int,
              exact=None) -> None:
        """key, value: [>= n, Hk * D] any float dtype; slots: int64 [n].
        exact: None, or (rows, blocks) int32 [m]: whole tiles of this step's
        known tokens, tile i being tokens [rows[i], rows[i] + G), committed
        into block blocks[i] straight from these K/V as given (fp32, or
        bf16/fp16 widened exactly) by kvarn_paged_commit_exact, after they
        are staged for attention (kvarn_paged_store)."""
        k, v = self._fp32(key, value, n, Hk, D)
        L = _lib.lib()
        _lib.check(L.kvarn_paged_store(ctypes.byref(view), k.data_ptr(), v.data_ptr(),
                                       slots.ctypes.data, n), "store")
        if exact is None or len(exact[0]) == 0:
            return
        rows, blocks = exact
        ws_bytes = self._commit_ws(view)
        _lib.check(L.kvarn_paged_commit_exact(ctypes.byref(view), k.data_ptr(), v.data_ptr(),
                                              n, rows.ctypes.data, blocks.ctypes.data,
                                              len(rows), None, self.cws.data_ptr(), ws_bytes),
                   "exact commit")

    def _fp32(self, key, value, n: int, Hk: int, D: int):
        """key[:n], value[:n] as contiguous fp32 [n, Hk, D]: the tensors
        themselves when they are that already, else converted into a
        buffer kept for the next store (a prefill step's fresh 2 x n x Hk x
        D floats would cost page faults and zeroing on top of the
        conversion, each layer). The values are used before the next
        store (kvarn_paged_store and the exact commit copy them)."""
        k, v = key[:n].reshape(n, Hk, D), value[:n].reshape(n, Hk, D)
        if k.dtype == torch.float32 and v.dtype == torch.float32:
            return k.contiguous(), v.contiguous()
        m = n * Hk * D
        if self.kv32 is None or self.kv32.shape[1] < m:
            self.kv32 = torch.empty(2, m, dtype=torch.float32)
        k32 = self.kv32[0, :m].view(n, Hk, D)
        v32 = self.kv32[1, :m].view(n, Hk, D)
        k32.copy_(k)
        v32.copy_(v)
        return k32, v32

    def _commit_ws(self, view) -> int:
        """Bytes of the commit workspace, self.cws grown to hold them."""
        ws_bytes = _lib.lib().kvarn_paged_commit_workspace_bytes(ctypes.byref(view))
        if self.cws is None or self.cws.numel() < ws_bytes:
            self.cws = torch.empty(ws_bytes, dtype=torch.uint8)  # 64-byte aligned
        return ws_bytes

    def commit(self, view, src: np.ndarray, dst: np.ndarray) -> None:
        """src: fp16 page ids, dst: block ids, int32 [n_tiles]."""
        L = _lib.lib()
        ws_bytes = self._commit_ws(view)
        _lib.check(L.kvarn_paged_commit(ctypes.byref(view), src.ctypes.data, dst.ctypes.data,
                                        len(src), None, self.cws.data_ptr(), ws_bytes), "commit")

    @staticmethod
    def seq_views(tables: np.ndarray, lens: np.ndarray, committed: np.ndarray,
                  sink_slots: np.ndarray):
        """The kvarn_seq_view array (attn.h) of one attention call: tables
        int32 [ng, W] contiguous, lens, committed, sink_slots int32 [ng].
        Built once a step and shared by the step's layers (backend.py): it
        keeps tables alive (the views point into it)."""
        ng = len(lens)
        seqs = (_lib.SeqView * ng)()
        base, row = tables.ctypes.data, tables.strides[0] if ng else 0
        for j in range(ng):
            sv = seqs[j]
            sv.block_table = base + j * row
            sv.seq_len = int(lens[j])
            sv.committed_tiles = int(committed[j])
            sv.sink_slot = int(sink_slots[j])
        seqs._tables = tables
        return seqs

    def attend(self, view, tables: np.ndarray, lens: np.ndarray, committed: np.ndarray,
               sink_slots: np.ndarray, qsl: np.ndarray, q: torch.Tensor, out: torch.Tensor,
               num_heads: int, scale: float, window: int, sinks=None, seqs=None) -> None:
        """tables int32 [ng, W] contiguous; lens, committed, sink_slots int32 [ng]
        (sink_slots read only when view.sink_partial > 0); qsl int32 [ng+1]
        (from 0); q, out [qsl[-1], Hq, D] contiguous, both fp32 or both
        bf16 (io_dtypes); sinks None or fp32 [Hq] contiguous, the learned
        sink logits (attn.h); seqs None or seq_views() of these arrays.
        The workspace is grown only when the call finds it too small
        (kvarn_attn_multi checks it before it writes anything)."""
        if q.dtype != out.dtype or q.dtype not in self.io_dtypes:
            raise _lib.KvarnError(f"kvarn: attention q/out dtypes {q.dtype}/{out.dtype}")
        L = _lib.lib()
        ng = len(lens)
        if seqs is None:
            seqs = self.seq_views(tables, lens, committed, sink_slots)
        opts = _lib.AttnOpts(scale, window, 1, None,
                             None if sinks is None else sinks.data_ptr(),
                             1 if q.dtype == torch.bfloat16 else 0)
        args = (ctypes.byref(view), ctypes.addressof(seqs), ng, qsl.ctypes.data, num_heads,
                q.data_ptr(), out.data_ptr(), ctypes.byref(opts), self.pool)
        st = (_lib.ERR_BUFFER_TOO_SMALL if self.ws is None
              else L.kvarn_attn_multi(*args, self.ws.data_ptr(), self.ws.numel()))
        if st == _lib.ERR_BUFFER_TOO_SMALL:
            ws_bytes = L.kvarn_attn_workspace_bytes(ctypes.byref(view), num_heads, ng,
                                                    int(q.shape[0]),
                                                    L.kvarn_thread_pool_size(self.pool),
                                                    ctypes.byref(opts))
            if ws_bytes == 0:
                raise _lib.KvarnError("kvarn: attention workspace size refused")
            if self.ws is None or self.ws.numel() < ws_bytes:
                self.ws = torch.empty(ws_bytes, dtype=torch.uint8)
            st = L.kvarn_attn_multi(*args, self.ws.data_ptr(), self.ws.numel())
        _lib.check(st, "attention")


class CudaOps:
    """The CUDA kernels (src/cuda), on the device of vLLM's cache tensors.
    Not run on this project's CPU machines; tests/vllm runs this class
    against tests/vllm/cuda_emulator.py (same calls, CPU kernels)."""
    name = "cuda"
    # the CUDA kernels commit from fp16 pages only (kvarn_cuda_commit): no
    # direct commit of a prefill chunk's whole tiles (settings.Settings.exact_commit)
    exact_commit = False
    _DTYPES = {torch.float16: _lib.CUDA_F16, torch.bfloat16: _lib.CUDA_BF16}
    io_dtypes = (torch.float32,)   # attend's q/out

    def __init__(self, device):
        self.device = torch.device(device)
        self.C = _lib.cuda_lib()
        n = ctypes.c_int(0)
        idx = self.device.index if self.device.index is not None else 0
        if self.device.type == "cuda":
            _lib.check(self.C.kvarn_cuda_sm_count(idx, ctypes.byref(n)), "CUDA device query")
        self.num_sms = n.value   # 0 (no split-K) where there is no device
        self.ws = None

    def _stream(self):
        if self.device.type != "cuda":
            return None
        return ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)

    def _dev(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def check(self, view) -> None:
        _lib.check(self.C.kvarn_cuda_check_kv(ctypes.byref(view)), "CUDA page layout check")

    def store(self, view, key, value, slots: np.ndarray, n: int, Hk: int, D: int,
              exact=None) -> None:
        if exact is not None and len(exact[0]):
            raise _lib.KvarnError("kvarn: the CUDA kernels have no exact commit")
        dt = self._DTYPES.get(key.dtype)
        if dt is None:
            raise _lib.KvarnError(
                f"kvarn: the CUDA store takes float16 or bfloat16 activations, not {key.dtype}; "
                "run the model with --dtype bfloat16 or float16")
        k = key[:n].reshape(n, Hk, D).contiguous()
        v = value[:n].reshape(n, Hk, D).contiguous()
        s = self._dev(slots.astype(np.int64))
        _lib.check(self.C.kvarn_cuda_store(ctypes.byref(view), dt, k.data_ptr(), v.data_ptr(),
                                           s.data_ptr(), n, self._stream()), "CUDA store")

    def commit(self, view, src: np.ndarray, dst: np.ndarray) -> None:
        s, d = self._dev(src.astype(np.int32)), self._dev(dst.astype(np.int32))
        _lib.check(self.C.kvarn_cuda_commit(ctypes.byref(view), s.data_ptr(), d.data_ptr(),
                                            len(src), None, self._stream()), "CUDA commit")

    seq_views = staticmethod(lambda *a: None)   # CpuOps' host array: not used here

    def attend(self, view, tables, lens, committed, sink_slots, qsl, q, out, num_heads, scale,
               window, sinks=None, seqs=None) -> None:
        # sink_slots: never read, cuda.h refuses sink_partial > 0 (check())
        ng = len(lens)
        shape = _lib.CudaAttnShape(ng, num_heads, int(tables.shape[1]), int(lens.max()),
                                   int(np.diff(qsl).max()), window, scale)
        plan = _lib.CudaAttnPlan()
        _lib.check(self.C.kvarn_cuda_attn_plan_make(ctypes.byref(view), ctypes.byref(shape),
                                                    self.num_sms, ctypes.byref(plan)),
                   "CUDA attention plan")
        need = int(plan.workspace_bytes)
        if need and (self.ws is None or self.ws.numel() < need):
            self.ws = torch.empty(need, dtype=torch.uint8, device=self.device)
        t, ln = self._dev(tables[:ng].astype(np.int32)), self._dev(lens.astype(np.int32))
        c, ql = self._dev(committed.astype(np.int32)), self._dev(qsl.astype(np.int32))
        sk = None if sinks is None else sinks.to(self.device, torch.float32).contiguous()
        args = _lib.CudaAttnArgs(q.data_ptr(), out.data_ptr(), t.data_ptr(), ln.data_ptr(),
                                 c.data_ptr(), ql.data_ptr(),
                                 None if sk is None else sk.data_ptr())
        ws_ptr = self.ws.data_ptr() if need else None
        _lib.check(self.C.kvarn_cuda_attention(ctypes.byref(view), ctypes.byref(plan),
                                               ctypes.byref(args), ws_ptr, need, self._stream()),
                   "CUDA attention")


def make_ops(device):
    """CudaOps for CUDA tensors (or when the test emulator is named), else
    CpuOps."""
    dev = torch.device(device)
    if dev.type == "cuda" or os.environ.get("KVARN_TEST_CUDA_EMULATOR"):
        return CudaOps(dev)
    return CpuOps(dev)
