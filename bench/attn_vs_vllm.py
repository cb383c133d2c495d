"""Attention alone, at the same shapes in one process: vLLM's own CPU
attention op (its CPU_ATTN backend's C++ kernels on a bf16 cache) against
kvarn's C attention call (kvarn_attn_multi over the plug-in's paged view of
records), with the ratio of their times and how far their outputs differ
(docs/vllm.md "Attention against vLLM's CPU op").

    .venv-vllm/bin/python bench/attn_vs_vllm.py [--shapes decode,verify,prefill]
        [--contexts 4096] [--queries 512] [--batch 4] [--prefill-batch 1]
        [--draft 5] [--heads smollm2|llama|HQ/HK/D] [--formats kvarn_k4v2_g128]
        [--repeats 10] [--seconds 3] [--threads N] [--reference] [--json FILE]

Shapes. A --shapes entry is decode (1 query row per sequence), verify
(1 + --draft rows per sequence: a speculative step), or prefill (a chunk
of --queries rows per sequence); each is the LAST rows of a context of
--contexts tokens, causal. An entry expands over every context (and, for
prefill, every chunk size) given, or names its own: prefill:1024@32k is a
chunk of 1024 queries over a 32768-token context, decode@8k one row over
8192. Decode and verify run --batch sequences, prefill --prefill-batch.
Head shape: --heads smollm2 (Hq 9, Hk 3, head_dim 64, the default),
llama (32/8/128), or HQ/HK/D.

vLLM: the calls its CPU backend makes (vllm/v1/attention/backends/
cpu_attn.py): the ISA its _get_attn_isa picks for a bf16 model and
vLLM's CPU block size (128), a [blocks, Hk, 128, 2 * D] bf16 cache filled
with the random K/V by its KV-update op (cpu_attn_reshape_and_cache), the
scheduler metadata its builder makes (cpu_attn_get_scheduler_metadata,
built once, not timed), and the timed op cpu_attention_with_kv_cache on
bf16 queries.

kvarn: the plug-in's ctypes layer (python/kvarn_vllm: _lib, ops.CpuOps)
of THIS checkout (its python/ goes first on sys.path, its build/
libkvarn.so is loaded). The same K/V (the bf16 values, as fp32) are
stored in the staging pool (kvarn_paged_store; the plug-in's staging,
KVARN_STAGING, int8 by default on CPU, and its KVARN_SINK_TILES) and every
full tile past the sink is committed to its record (kvarn_paged_commit),
as the plug-in leaves a cache. The timed call is one kvarn_attn_multi
with the plug-in's grouping (staging.py StepPlan, docs/vllm.md "A
step"): one entry per (sequence, tile) of queries, the tiles before it
read from their records (the sink from staging), its own tile from
staging up to each query (a partial last tile stays staged).
Queries and outputs are fp32 (the plug-in converts the model's bf16). A
per-token format (bf16, int8, fp8_e4m3, ...; the C library serves them,
the plug-in does not) is stored as records at once and attended as one
entry per sequence: a check of the call at near-exact precision.

Timing: one warm-up call of each, then up to --repeats calls of each,
alternating (at least 3, fewer than --repeats once --seconds have passed
for the shape), time.perf_counter around the op alone; best and median,
in ms. Threads: --threads (default torch's) for both, torch's OpenMP
threads for vLLM and a kvarn thread pool of the same size; pin the process
to idle cores (e.g. OMP_NUM_THREADS=1 KVARN_ATTN_THREADS=1 taskset -c 0).
Agreement: rel_err = ||kvarn - vLLM|| / ||vLLM|| over all outputs, beside
shuffled_err, the same with kvarn's output rows (token, head) permuted (what
an unrelated output would give); --reference adds each one's error
against an fp64 attention of the same bf16 K/V and queries (small shapes:
it costs B * Q * C * Hq * D products in Python's torch).
"""
import argparse
import ctypes
import json
import math
import os
import platform
import statistics
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))   # this checkout's plug-in

import numpy as np   # noqa: E402
import torch   # noqa: E402

HEADS = {"smollm2": (9, 3, 64), "llama": (32, 8, 128)}
VLLM_BLOCK = 128   # vLLM's CPU block size when none is given (platforms/cpu.py)
KINDS = ("decode", "verify", "prefill")


# ---------------------------------------------------------------- shapes
def parse_tokens(s: str) -> int:
    """"4096", "4k" (4096), "32K" -> tokens."""
    s = s.strip().lower()
    return int(s[:-1]) * 1024 if s.endswith("k") else int(s)


def parse_heads(s: str) -> tuple:
    """--heads: a preset name of HEADS or "HQ/HK/D" -> (Hq, Hk, D)."""
    if s in HEADS:
        return HEADS[s]
    hq, hk, d = (int(x) for x in s.split("/"))
    if hq % hk:
        raise ValueError(f"--heads {s}: Hq must be a multiple of Hk")
    return hq, hk, d


def parse_shapes(shapes: str, contexts: list, queries: list, batch: int,
                 prefill_batch: int, draft: int) -> list:
    """The shapes to run: a list of {"kind", "batch", "queries" (rows per
    sequence), "context" (tokens)} from the --shapes entries (module
    docstring): kind[:queries][@context]. A prefill chunk longer than its
    context is left out."""
    out = []
    for e in (x.strip() for x in shapes.split(",") if x.strip()):
        kind, _, ctx = e.partition("@")
        kind, _, q = kind.partition(":")
        if kind not in KINDS:
            raise ValueError(f"--shapes: unknown kind {kind!r} (one of {', '.join(KINDS)})")
        if q and kind != "prefill":
            raise ValueError(f"--shapes {e}: only prefill takes :queries (verify: --draft)")
        ctxs = [parse_tokens(ctx)] if ctx else contexts
        if kind == "decode":
            qs, b = [1], batch
        elif kind == "verify":
            qs, b = [1 + draft], batch
        else:
            qs, b = ([parse_tokens(q)] if q else queries), prefill_batch
        for c in ctxs:
            for n in qs:
                if n <= c:
                    out.append({"kind": kind, "batch": b, "queries": n, "context": c})
    return out


def make_inputs(batch: int, queries: int, context: int, heads: tuple, seed: int = 0) -> dict:
    """Random bf16 K, V [batch, context, Hk, D] and queries [batch * queries,
    Hq, D] (standard normal, rounded to bf16): the same values go to
    both caches."""
    hq, hk, d = heads
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    return {"k": torch.randn(batch, context, hk, d, generator=g).to(bf),
            "v": torch.randn(batch, context, hk, d, generator=g).to(bf),
            "q": torch.randn(batch * queries, hq, d, generator=g).to(bf)}


# ---------------------------------------------------------------- vLLM
def vllm_isa(head_dim: int, block_size: int = VLLM_BLOCK) -> str:
    """The ISA vLLM's CPU backend picks for a bf16 model with a bf16
    ("auto") cache: its own _get_attn_isa ("amx", "vec", "vec16", "neon", ...)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    return _get_attn_isa(torch.bfloat16, block_size, head_dim, "auto")


class VllmAttn:
    """vLLM's CPU attention on its bf16 paged cache, as CPU_ATTN calls it.
    k, v: bf16 [B, C, Hk, D]; queries: rows per sequence (the last of each
    context, causal); call(q, out): q, out bf16 [B * queries, Hq, D]."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, queries: int, n_heads: int,
                 block_size: int = VLLM_BLOCK):
        from vllm import _custom_ops as ops
        from vllm import envs
        self.ops = ops
        B, C, Hk, D = k.shape
        self.isa = vllm_isa(D, block_size)
        nbs = -(-C // block_size)
        nb = B * nbs
        cache = torch.zeros(nb, Hk, block_size, 2 * D, dtype=torch.bfloat16)
        # the backend's view: [blocks, Hk, 2 * block, D], K the first half
        self.kc, self.vc = cache.view(nb, Hk, 2 * block_size, D).chunk(2, dim=2)
        self.cache = cache
        for s in range(B):
            slots = s * nbs * block_size + torch.arange(C, dtype=torch.int64)
            ops.cpu_attn_reshape_and_cache(k[s], v[s], self.kc, self.vc, slots, self.isa)
        self.block_table = torch.arange(nb, dtype=torch.int32).view(B, nbs)
        self.qsl = torch.arange(B + 1, dtype=torch.int32) * queries
        self.seq_lens = torch.full((B,), C, dtype=torch.int32)
        self.scale = D ** -0.5
        self.split_kv = bool(envs.VLLM_CPU_ATTN_SPLIT_KV)
        self.md = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=B, num_heads=n_heads, num_kv_heads=Hk, head_dim=D, seq_lens=self.seq_lens,
            dtype=torch.bfloat16, query_start_loc=self.qsl, causal=True,
            sliding_window_size=-1, isa=self.isa, enable_kv_split=self.split_kv,
            kv_cache_dtype="auto")

    def __call__(self, q: torch.Tensor, out: torch.Tensor) -> None:
        self.ops.cpu_attention_with_kv_cache(
            query=q, key_cache=self.kc, value_cache=self.vc, output=out,
            query_start_loc=self.qsl, seq_lens=self.seq_lens, scale=self.scale, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=self.block_table, softcap=0.0,
            scheduler_metadata=self.md, s_aux=None)


# ---------------------------------------------------------------- kvarn
def plugin_settings(tile: int) -> tuple:
    """(staging, sink_tiles) as the plug-in serves a CPU cache of tiles of
    `tile` tokens: its settings (settings.py: KVARN_STAGING, int8 by
    default on CPU; KVARN_SINK_TILES, 1 by default); a sink
    shorter than a tile (KVARN_SINK_TOKENS) is not benchmarked here."""
    from kvarn_vllm.settings import Settings
    settings = Settings.from_env()
    staging = settings.staging_kind("cpu")
    sink_tiles, partial = settings.sink(tile)
    if partial:
        raise ValueError("attn_vs_vllm: KVARN_SINK_TOKENS with a partial tile is not "
                         "benchmarked; use KVARN_SINK_TILES")
    return staging, sink_tiles


class KvarnAttn:
    """kvarn_attn_multi over records of fmt_name, as the plug-in calls it.
    k, v: bf16 [B, C, Hk, D] (stored as their fp32 values); queries: rows
    per sequence; ops: a kvarn_vllm.ops.CpuOps (its thread pool); staging
    and sink tiles: the plug-in's (plugin_settings); a per-token format
    in blocks of per_token_block tokens. call(q, out): fp32 [B * queries,
    Hq, D] contiguous."""

    def __init__(self, fmt_name: str, k: torch.Tensor, v: torch.Tensor, queries: int,
                 n_heads: int, ops, per_token_block: int = VLLM_BLOCK):
        from kvarn_vllm import _lib
        self._lib, self.ops = _lib, ops
        B, C, Hk, D = k.shape
        fmt = _lib.parse_format(fmt_name, D)
        self.fmt, self.n_heads = fmt, n_heads
        self.kvarn = fmt.kind == _lib.KIND_KVARN
        G = fmt.tile_tokens if self.kvarn else per_token_block
        rb = _lib.record_bytes(fmt, D)
        nt = -(-C // G)
        nb = B * nt
        view = _lib.PagedKV()
        view.fmt, view.head_dim, view.n_kv_heads, view.block_size = fmt, D, Hk, G
        staging, sink_tiles = plugin_settings(G) if self.kvarn else (0, 0)
        if self.kvarn:
            # vLLM's page of records (backend.customize_spec) and a staging
            # page per tile (ids = block ids): the pool as the plug-in has it
            self.blocks = torch.zeros(nb, Hk, rb, dtype=torch.uint8)
            _, _, srec = _lib.staged_bytes(fmt, 1, Hk, D, sink_tiles, 0, staging)
            if staging == _lib.STAGING_FP16:
                self.pages = torch.zeros(nb, Hk, 2, G, D, dtype=torch.int16)
            else:
                self.pages = torch.zeros(nb, Hk, G, srec, dtype=torch.uint8)
            view.sink_tiles, view.staging, view.staging_record_bytes = sink_tiles, staging, srec
            view.fp16_pages = self.pages.data_ptr()
            view.page_stride = self.pages.stride(0) * self.pages.element_size()
            view.page_head_stride = self.pages.stride(1) * self.pages.element_size()
            view.n_fp16_pages = nb
        else:
            self.blocks = torch.zeros(nb, Hk, G * rb, dtype=torch.uint8)
            view.token_record_bytes = rb
        view.blocks = self.blocks.data_ptr()
        view.block_stride = self.blocks.stride(0)
        view.record_stride = self.blocks.stride(1)
        view.n_blocks = nb
        self.view = view
        ops.check(view)
        # store every token (into staging for KVarN, its record otherwise),
        # then commit every full tile past the sink
        for s in range(B):
            for a in range(0, C, 4096):
                n = min(4096, C - a)
                slots = (s * nt * G + a + np.arange(n)).astype(np.int64)
                ops.store(view, k[s, a:a + n].reshape(n, Hk * D), v[s, a:a + n].reshape(n, Hk * D),
                          slots, n, Hk, D)
            if self.kvarn:
                ids = (s * nt + np.arange(sink_tiles, C // G)).astype(np.int32)
                for a in range(0, len(ids), 64):
                    ops.commit(view, ids[a:a + 64], ids[a:a + 64])
        # the entries: KVarN one per (sequence, tile) of queries, as the
        # plug-in's plan (staging.py _group_views); per-token one per sequence
        tables, lens, committed, qsl = [], [], [], [0]
        for s in range(B):
            row = (s * nt + np.arange(nt)).astype(np.int32)
            first = C - queries
            tiles = range(first // G, (C - 1) // G + 1) if self.kvarn else [None]
            for t in tiles:
                end = C if t is None else min((t + 1) * G, C)
                tables.append(row)
                lens.append(end)
                committed.append(0 if t is None else t)
                qsl.append(qsl[-1] + end - max(first, 0 if t is None else t * G))
        self.tables = np.ascontiguousarray(np.stack(tables))
        self.n_groups = len(lens)
        seqs = (_lib.SeqView * self.n_groups)()
        for j in range(self.n_groups):
            seqs[j].block_table = self.tables[j].ctypes.data
            seqs[j].seq_len, seqs[j].committed_tiles = int(lens[j]), int(committed[j])
            seqs[j].sink_slot = -1
        self.seqs = seqs
        self.qsl = np.array(qsl, dtype=np.int32)
        assert self.qsl[-1] == B * queries
        self.opts = _lib.AttnOpts(D ** -0.5, 0, 1, None, None)
        L = _lib.lib()
        nthr = L.kvarn_thread_pool_size(ops.pool)
        ws = L.kvarn_attn_workspace_bytes(ctypes.byref(view), n_heads, self.n_groups,
                                          B * queries, nthr, ctypes.byref(self.opts))
        if ws == 0:
            raise _lib.KvarnError("kvarn: attention workspace size refused")
        self.ws = torch.empty(ws, dtype=torch.uint8)
        self.threads = nthr
        self.kernel_info = _lib.attn_kernel_info(fmt, D, view.staging)
        self.staging = _lib.staging_name(view.staging) if self.kvarn else None
        self.sink_tiles = sink_tiles
        self.record_bytes = rb

    def __call__(self, q: torch.Tensor, out: torch.Tensor) -> None:
        # ops.CpuOps.attend's call, its arguments made once
        L = self._lib.lib()
        self._lib.check(L.kvarn_attn_multi(
            ctypes.byref(self.view), ctypes.addressof(self.seqs), self.n_groups,
            self.qsl.ctypes.data, self.n_heads, q.data_ptr(), out.data_ptr(),
            ctypes.byref(self.opts), self.ops.pool, self.ws.data_ptr(), self.ws.numel()),
            "attention")


# ---------------------------------------------------------------- measure
def reference(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, queries: int) -> torch.Tensor:
    """fp64 causal attention of q [B * queries, Hq, D] (the last queries
    of each sequence) over k, v [B, C, Hk, D]: [B * queries, Hq, D]."""
    B, C, Hk, D = k.shape
    Hq = q.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    pos = torch.arange(C - queries, C)[:, None]
    mask = torch.arange(C)[None, :] > pos
    for s in range(B):
        K = k[s].double().repeat_interleave(Hq // Hk, dim=1)
        V = v[s].double().repeat_interleave(Hq // Hk, dim=1)
        qq = q[s * queries:(s + 1) * queries].double()
        sc = torch.einsum("qhd,khd->hqk", qq, K) * D ** -0.5
        sc = sc.masked_fill(mask, -math.inf)
        out[s * queries:(s + 1) * queries] = torch.einsum("hqk,khd->qhd", sc.softmax(-1), V)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| over all elements (fp64)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def shuffled_err(a: torch.Tensor, b: torch.Tensor, seed: int = 1) -> float:
    """rel_err with a's rows ([tokens, heads] flattened) permuted: what an
    output unrelated to b row by row would give."""
    rows = a.reshape(-1, a.shape[-1])
    perm = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(seed))
    return rel_err(rows[perm], b.reshape(rows.shape))


def time_pair(f_a, f_b, repeats: int, seconds: float) -> tuple:
    """Call f_a and f_b alternately (after one warm-up call of each) up to
    repeats times each, at least 3, stopping early once `seconds` have
    passed: (times of f_a, times of f_b), lists of seconds."""
    f_a()
    f_b()
    ta, tb = [], []
    t_end = time.perf_counter() + seconds
    while len(ta) < repeats and (len(ta) < 3 or time.perf_counter() < t_end):
        t = time.perf_counter()
        f_a()
        ta.append(time.perf_counter() - t)
        t = time.perf_counter()
        f_b()
        tb.append(time.perf_counter() - t)
    return ta, tb


def run_shape(shape: dict, heads: tuple, formats: list, ops, repeats: int = 10,
              seconds: float = 3.0, with_reference: bool = False, seed: int = 0) -> list:
    """One shape ({"kind", "batch", "queries", "context"}, parse_shapes),
    vLLM against each kvarn format: a list of result dicts, one per format,
    with the shape's keys, "format", "vllm_ms_best", "vllm_ms_median",
    "kvarn_ms_best", "kvarn_ms_median" (ms a call), "ratio_best",
    "ratio_median" (kvarn / vLLM), "rel_err", "shuffled_err" (kvarn vs
    vLLM, relative), "repeats", "groups" (kvarn entries), "vllm_isa",
    "kvarn_kernel" (_lib.attn_kernel_info), "staging" (None for a
    per-token format), "sink_tiles", and with_reference "vllm_ref_err",
    "kvarn_ref_err" (each against fp64 attention, relative)."""
    B, Q, C = shape["batch"], shape["queries"], shape["context"]
    hq = heads[0]
    x = make_inputs(B, Q, C, heads, seed)
    ref = reference(x["k"], x["v"], x["q"], Q) if with_reference else None
    va = VllmAttn(x["k"], x["v"], Q, hq)
    q_bf, out_bf = x["q"], torch.empty_like(x["q"])
    q32 = x["q"].float().contiguous()
    res = []
    for name in formats:
        ka = KvarnAttn(name, x["k"], x["v"], Q, hq, ops)
        out32 = torch.empty_like(q32)
        tv, tk = time_pair(lambda: va(q_bf, out_bf), lambda: ka(q32, out32), repeats, seconds)
        vb, vm = 1e3 * min(tv), 1e3 * statistics.median(tv)
        kb, km = 1e3 * min(tk), 1e3 * statistics.median(tk)
        r = dict(shape, format=name, vllm_ms_best=vb, vllm_ms_median=vm, kvarn_ms_best=kb,
                 kvarn_ms_median=km, ratio_best=kb / vb, ratio_median=km / vm,
                 rel_err=rel_err(out32, out_bf), shuffled_err=shuffled_err(out32, out_bf),
                 repeats=len(tv), groups=ka.n_groups, vllm_isa=va.isa,
                 kvarn_kernel=ka.kernel_info, staging=ka.staging, sink_tiles=ka.sink_tiles)
        if ref is not None:
            r["vllm_ref_err"], r["kvarn_ref_err"] = rel_err(out_bf, ref), rel_err(out32, ref)
        res.append(r)
        del ka
    return res


SIMD_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_name() -> str:
    """The CPU as /proc/cpuinfo names it, with its family and model and the
    SIMD flags of SIMD_FLAGS it has, e.g. "AMD EPYC (family 25, model 1;
    avx2)"."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                k = k.strip()
                if k in ("model name", "cpu family", "model", "flags") and k not in info:
                    info[k] = v.strip()
                if not line.strip() and info:
                    break
    except OSError:
        pass
    if "model name" not in info:
        return platform.processor() or platform.machine()
    flags = set(info.get("flags", "").split())
    simd = ", ".join(f for f in SIMD_FLAGS if f in flags) or "no AVX2"
    return (f"{info['model name']} (family {info.get('cpu family', '?')}, "
            f"model {info.get('model', '?')}; {simd})")


def run(shapes: list, heads: tuple, formats: list, threads: int = 0, repeats: int = 10,
        seconds: float = 3.0, with_reference: bool = False, seed: int = 0,
        progress=None) -> dict:
    """Every shape (parse_shapes) for every format: {"cpu", "threads",
    "heads": {"Hq", "Hk", "D"}, "vllm": {"version", "isa", "block_size",
    "split_kv"}, "kvarn": {"library", "formats": {name: {"kernel" (as
    _lib.attn_kernel_info), "staging", "sink_tiles", "record_bytes" (of a
    tile record, KVarN, or a token record), "key_bits", "value_bits"}}},
    "results": [run_shape's dicts]}.
    threads 0: torch's current count. progress: called as progress(the
    dict so far, result) after each result. torch's thread count and the
    environment are as they were on return."""
    saved = torch.get_num_threads()
    try:
        return _run(shapes, heads, formats, threads or saved, repeats, seconds,
                    with_reference, seed, progress)
    finally:
        torch.set_num_threads(saved)


def _run(shapes, heads, formats, threads, repeats, seconds, with_reference, seed, progress):
    import vllm
    from vllm import envs
    from kvarn_vllm import _lib
    from kvarn_vllm.ops import CpuOps
    torch.set_num_threads(threads)
    env = os.environ.get("KVARN_ATTN_THREADS")
    os.environ["KVARN_ATTN_THREADS"] = str(threads)   # CpuOps' pool: the same count
    try:
        ops = CpuOps("cpu")
    finally:
        if env is None:
            del os.environ["KVARN_ATTN_THREADS"]
        else:
            os.environ["KVARN_ATTN_THREADS"] = env
    hq, hk, d = heads
    out = {"cpu": cpu_name(), "threads": threads, "heads": {"Hq": hq, "Hk": hk, "D": d},
           "vllm": {"version": vllm.__version__, "isa": vllm_isa(d), "block_size": VLLM_BLOCK,
                    "split_kv": bool(envs.VLLM_CPU_ATTN_SPLIT_KV)},
           "kvarn": {"library": _lib._find_library(), "formats": {}}, "results": []}
    for name in formats:
        fmt = _lib.parse_format(name, d)
        kv = fmt.kind == _lib.KIND_KVARN
        staging, sink_tiles = plugin_settings(fmt.tile_tokens) if kv else (0, 0)
        out["kvarn"]["formats"][name] = {
            "kernel": _lib.attn_kernel_info(fmt, d, staging if kv else 0),
            "staging": _lib.staging_name(staging) if kv else None,
            "sink_tiles": sink_tiles if kv else 0, "record_bytes": _lib.record_bytes(fmt, d),
            "key_bits": fmt.key_bits, "value_bits": fmt.value_bits}
    for sh in shapes:
        for r in run_shape(sh, heads, formats, ops, repeats, seconds, with_reference, seed):
            out["results"].append(r)
            if progress:
                progress(out, r)
    return out


def shape_name(r: dict) -> str:
    return f"{r['kind']} b{r['batch']}"


def header(d: dict) -> str:
    h = d["heads"]
    lines = [f"CPU: {d['cpu']}; threads {d['threads']}; heads Hq {h['Hq']} Hk {h['Hk']} "
             f"D {h['D']}",
             f"vLLM {d['vllm']['version']}: CPU_ATTN ISA {d['vllm']['isa']!r}, bf16 cache, "
             f"block {d['vllm']['block_size']}, split-KV {d['vllm'].get('split_kv')}"]
    for name, f in d["kvarn"]["formats"].items():
        k = f["kernel"]
        st = f", staging {f['staging']} ({k['staged_scores']}/{k['staged_sums']}), " \
             f"sink tiles {f['sink_tiles']}" if f["staging"] else ""
        mat = f", matrix {k['matrix']} ({k['matrix_scores']}/{k['matrix_sums']}) for items of " \
              f"{k['matrix_rows']}+ rows" + (f", their staged tokens too in items of {k['matrix_staged']}+ queries"
                                          if k.get("matrix_staged") else "") \
            if k.get("matrix") else ""
        lines.append(f"kvarn {name}: {k['level']} kernels, scores {k['scores']}, "
                     f"sums {k['sums']}{st}{mat}")
    return "\n".join(lines)


COLS = (f"{'shape':10} {'format':18} {'Q/seq':>6} {'context':>7} {'vLLM ms':>21} "
        f"{'kvarn ms':>21} {'kvarn/vLLM':>12} {'rel err':>8} {'shuffled':>8}")


def row(r: dict) -> str:
    """One table line: best / median ms, ratio of bests (of medians)."""
    line = (f"{shape_name(r):10} {r['format']:18} {r['queries']:>6} {r['context']:>7} "
            f"{r['vllm_ms_best']:>9.3f} / {r['vllm_ms_median']:<9.3f}"
            f"{r['kvarn_ms_best']:>9.3f} / {r['kvarn_ms_median']:<9.3f}"
            f"{r['ratio_best']:>6.2f} ({r['ratio_median']:.2f})"
            f"{r['rel_err']:>8.4f} {r['shuffled_err']:>8.3f}")
    if "vllm_ref_err" in r:
        line += f"  vs fp64: vLLM {r['vllm_ref_err']:.4f}, kvarn {r['kvarn_ref_err']:.4f}"
    return line


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="decode,verify,prefill",
                    help="kind[:queries][@context],... (kinds: decode, verify, prefill)")
    ap.add_argument("--contexts", default="4096", help="context tokens, e.g. 1k,4k,32k")
    ap.add_argument("--queries", default="512", help="prefill chunk sizes, e.g. 128,512,4096")
    ap.add_argument("--batch", type=int, default=4, help="sequences of decode and verify")
    ap.add_argument("--prefill-batch", type=int, default=1, help="sequences of prefill")
    ap.add_argument("--draft", type=int, default=5, metavar="K", help="verify rows: 1 + K")
    ap.add_argument("--heads", default="smollm2", help="smollm2 (9/3/64), llama (32/8/128) "
                    "or HQ/HK/D")
    ap.add_argument("--formats", default="kvarn_k4v2_g128")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=3.0,
                    help="per shape and format: stop repeating (after 3) past this")
    ap.add_argument("--threads", type=int, default=0, help="0: torch's count")
    ap.add_argument("--reference", action="store_true",
                    help="also each one's error against fp64 attention (small shapes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    heads = parse_heads(a.heads)
    shapes = parse_shapes(a.shapes, [parse_tokens(c) for c in a.contexts.split(",")],
                          [parse_tokens(q) for q in a.queries.split(",")], a.batch,
                          a.prefill_batch, a.draft)
    def progress(d, r):
        if len(d["results"]) == 1:
            print(header(d))
            print("ms: best / median a call; kvarn/vLLM: ratio of the best (of the median) "
                  "times; rel err: ||kvarn - vLLM|| / ||vLLM||; shuffled: the same with "
                  "kvarn's rows permuted")
            print(COLS, flush=True)
        print(row(r), flush=True)
    d = run(shapes, heads, a.formats.split(","), a.threads, a.repeats, a.seconds, a.reference,
            a.seed, progress)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(d, f, indent=1)
    return d


if __name__ == "__main__":
    main()
