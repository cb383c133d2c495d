"""Testing only: libkvarn_cuda.so's entry points as the plug-in calls them,
served on the CPU, so that the plug-in's CUDA path (python/kvarn_vllm/
ops.py CudaOps: views, dtypes, plans, device arrays, workspaces) runs on a
machine without a GPU. Named by $KVARN_TEST_CUDA_EMULATOR (see _lib.cuda_lib).

The host-side functions that need no GPU (kvarn_cuda_check_kv,
kvarn_cuda_attn_plan_make) are the real ones from build/libkvarn_cuda.so
when it was built (nvcc found); the kernels (store, commit, attention) are
replaced by the plug-in's own CpuOps on the same host pointers, after checking each
argument against include/kvarn/cuda.h's contract: a marshalling mistake in
CudaOps (wrong dtype code, plan not matching the call, a query count above
max_query_len, a short workspace) fails here as it would on the GPU.
"""
import ctypes
import os

import numpy as np
import torch

from kvarn_vllm import _lib
from kvarn_vllm.ops import CpuOps

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
INVALID_ARG, BUFFER_TOO_SMALL = -1, -5


def _arr(ptr, ctype, count) -> np.ndarray:
    return np.ctypeslib.as_array((ctype * count).from_address(ptr))


class Emulator:
    def __init__(self):
        self.cpu = CpuOps("cpu")  # the plug-in's own CPU path does the work
        real = os.path.join(ROOT, "build", "libkvarn_cuda.so")
        self.real = None
        if os.path.exists(real):
            self.real = ctypes.CDLL(real)
            P = ctypes.POINTER
            self.real.kvarn_cuda_check_kv.argtypes = [P(_lib.PagedKV)]
            self.real.kvarn_cuda_attn_plan_make.argtypes = [
                P(_lib.PagedKV), P(_lib.CudaAttnShape), ctypes.c_int, P(_lib.CudaAttnPlan)]
        self.calls = {"store": 0, "commit": 0, "attention": 0}

    @staticmethod
    def _run(fn, *args) -> int:
        """A CpuOps call as a C status: 0, or the library's status on error."""
        try:
            fn(*args)
        except _lib.KvarnError as e:
            return e.status
        return 0

    # -- host-only functions: the real library where it was built ----------
    def kvarn_cuda_check_kv(self, kv_ref):
        if self.real is not None:
            return self.real.kvarn_cuda_check_kv(kv_ref)
        return _lib.lib().kvarn_paged_check(kv_ref)

    def kvarn_cuda_sm_count(self, device, n_ref):
        return -12  # KVARN_ERR_NO_DEVICE: CudaOps asks only for CUDA tensors

    def kvarn_cuda_attn_plan_make(self, kv_ref, shape_ref, num_sms, plan_ref):
        if self.real is not None:
            return self.real.kvarn_cuda_attn_plan_make(kv_ref, shape_ref, num_sms, plan_ref)
        plan = plan_ref._obj
        plan.shape = shape_ref._obj
        plan.num_splits, plan.workspace_bytes = 1, 0
        return 0

    # -- kernels: CpuOps on the same pages ---------------------------------
    def kvarn_cuda_store(self, kv_ref, dtype, k, v, slots, n, stream):
        kv = kv_ref._obj
        if dtype not in (_lib.CUDA_F16, _lib.CUDA_BF16) or n < 0 or not (k and v and slots):
            return INVALID_ARG
        self.calls["store"] += 1
        if n == 0:
            return 0
        Hk, D = kv.n_kv_heads, kv.head_dim
        tdt = torch.float16 if dtype == _lib.CUDA_F16 else torch.bfloat16

        def half(ptr):  # the device tensor, read in place as its dtype
            raw = torch.from_numpy(_arr(ptr, ctypes.c_int16, n * Hk * D))
            return raw.view(tdt).view(n, Hk, D)
        return self._run(self.cpu.store, kv, half(k), half(v),
                         _arr(slots, ctypes.c_int64, n), n, Hk, D)

    def kvarn_cuda_commit(self, kv_ref, src, dst, n, opts, stream):
        if n < 0 or (n > 0 and not (src and dst)):
            return INVALID_ARG
        self.calls["commit"] += 1
        if n == 0:
            return 0
        return self._run(self.cpu.commit, kv_ref._obj, _arr(src, ctypes.c_int32, n),
                         _arr(dst, ctypes.c_int32, n))

    def kvarn_cuda_attention(self, kv_ref, plan_ref, args_ref, ws, ws_bytes, stream):
        kv, plan, a = kv_ref._obj, plan_ref._obj, args_ref._obj
        sh = plan.shape
        if not (a.q and a.out and a.block_tables and a.seq_lens and a.committed_tiles):
            return INVALID_ARG
        if sh.num_seqs < 1 or sh.num_heads % kv.n_kv_heads != 0:
            return INVALID_ARG
        if ws_bytes < plan.workspace_bytes or (plan.workspace_bytes and not ws):
            return BUFFER_TOO_SMALL
        ns, W = sh.num_seqs, sh.max_blocks_per_seq
        tables = _arr(a.block_tables, ctypes.c_int32, ns * W).reshape(ns, W)
        lens = _arr(a.seq_lens, ctypes.c_int32, ns)
        committed = _arr(a.committed_tiles, ctypes.c_int32, ns)
        if a.query_start_loc:
            qsl = _arr(a.query_start_loc, ctypes.c_int32, ns + 1)
        else:
            qsl = np.arange(ns + 1, dtype=np.int32)
        G = kv.block_size
        # cuda.h's contract for the plan this call was made with
        if (lens > sh.max_seq_len).any() or (np.diff(qsl) > sh.max_query_len).any() \
                or (np.diff(qsl) < 0).any() or ((lens + G - 1) // G > W).any() \
                or (np.diff(qsl) > lens).any():
            return INVALID_ARG
        self.calls["attention"] += 1
        shape = (int(qsl[-1]), sh.num_heads, kv.head_dim)

        def f32(ptr):  # fp32 [num_q][Hq][D], read and written in place
            return torch.from_numpy(_arr(ptr, ctypes.c_float, int(np.prod(shape)))).view(shape)
        sinks = None  # learned sink logits, fp32 [Hq] (cuda.h)
        if a.sinks:
            sinks = torch.from_numpy(_arr(a.sinks, ctypes.c_float, sh.num_heads).copy())
        return self._run(self.cpu.attend, kv, tables, lens, committed,
                         np.full(ns, -1, dtype=np.int32), qsl, f32(a.q), f32(a.out),
                         sh.num_heads, sh.softmax_scale, sh.sliding_window, sinks)


def library():
    return Emulator()
