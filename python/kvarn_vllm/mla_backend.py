"""MLA models (DeepSeek-V2/V3/R1, Kimi-K2: multi-head latent attention) in
a kvarn_mla_* cache: the vLLM backend, and the start-up checks.

An MLA layer caches, per token, one kv_lora_rank-wide latent c_kv (RMS
normed) and one qk_rope_head_dim-wide RoPE key k_pe, shared by all its
query heads (DeepSeek-V2, arXiv:2405.04434, section 2.1); vLLM 0.32's CPU
build serves it with CPU_MLA (AMX_MLA where the CPU has AMX tiles): the
prompt as MHA on the fresh latents, each decoded token as absorbed MQA over
the cache. The kvarn formats of ordinary layers (kvarn_k*v*_g*) store K and
V tiles per KV head, which an MLA layer has none of; its formats are the
MLA records (include/kvarn/mla.h, docs/mla.md; e.g. kvarn_mla_k4_g128: the
latent as a 4-bit KVarN K tile, the RoPE key int8 per token).

KvarnMLABackend (CPU tensors; over vLLM's CPU_MLA, whose prefill it keeps):
  cache    per layer [blocks, G, record_bytes / G] uint8, G = the format's
           tile = vLLM's block size: block b holds one record (mla.h) of
           the G tokens its block-table slot maps, once they are all
           stored; vLLM's KV budget pays for the records.
  tail     a tile not yet full sits in an fp32 slot of the tail pool
           ([slots, G, kv_lora_rank] latent and [slots, G, qk_rope_head_dim]
           RoPE key per layer, taken out of vLLM's KV budget by the worker,
           reserve_tail_pool), one slot per sequence, keyed by its block.
  store    (do_kv_cache_update) a step's fresh rows: a whole tile of a
           prompt encodes straight into its block's record
           (kvarn_mla_encode); the rest are copied into the slot of their
           block; a slot that becomes full is encoded into the block's
           record and freed. Every stored token is one vLLM accepted
           (speculative decoding is refused for MLA).
  decode   (forward_mqa) per decode request kvarn_mla_attn over its
           committed records and its tail slot, with vLLM's absorbed query
           (q_nope W_UK, q_pe) and softmax scale; W_UV after is vLLM's.
  prefill  vLLM's MHA on the fresh latents (no cache read): chunked prefill
           and prefix caching are turned off for a kvarn_mla_* cache
           (check_mla_model), as vLLM's CPU platform does for its CPU_MLA.
"""
import numpy as np
import torch

from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from . import _lib
from ._lib import is_mla_dtype, mla_dtype_names


def mla_dims(model_config) -> tuple:
    """(kv_lora_rank, qk_rope_head_dim, query heads) of an MLA model's text
    config; fields missing from a config read 0."""
    hf = model_config.hf_text_config
    return (int(getattr(hf, "kv_lora_rank", 0) or 0),
            int(getattr(hf, "qk_rope_head_dim", 0) or 0),
            int(getattr(hf, "num_attention_heads", 0) or 0))


def check_mla_model(vllm_config) -> None:
    """checks.check_model for a model that vLLM runs with MLA
    (model_config.use_mla) and a kvarn --kv-cache-dtype, in the front end:
    a kvarn format of ordinary layers, an MLA format that cannot hold the
    model's latent / RoPE widths, speculative decoding or a device other
    than CPU raise ValueError with the reason; otherwise the block size is
    set to the format's tile (vLLM's CPU platform forced 16 for CPU_MLA)
    and chunked prefill and prefix caching are turned off (the prompt must
    run as MHA on fresh latents: KvarnMLAImpl reads no cache in prefill)."""
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    sc = vllm_config.scheduler_config
    name = cc.cache_dtype
    latent, rope, heads = mla_dims(mc)
    shape = (f"multi-head latent attention (MLA: per token one {latent}-wide latent and one "
             f"{rope}-wide RoPE key, shared by its {heads} query heads)")
    if _lib.is_per_token_dtype(name):
        raise ValueError(
            f"kvarn: {mc.model} uses {shape}; {name} is a per-token format that stores one "
            f"K and one V record per token and KV head, which an MLA layer does not have "
            f"(the per-token formats are not served on MLA models): use an MLA record format "
            f"(--kv-cache-dtype kvarn_mla_k4_g128, docs/vllm-models.md \"MLA\") or vLLM's "
            f"own cache (--kv-cache-dtype auto)")
    if not is_mla_dtype(name):
        raise ValueError(
            f"kvarn: {mc.model} uses {shape}; {name} stores K and V tiles per KV head, which "
            f"an MLA layer does not have: use an MLA record format (--kv-cache-dtype "
            f"kvarn_mla_k4_g128, docs/vllm-models.md \"MLA\") or vLLM's own cache "
            f"(--kv-cache-dtype auto)")
    try:
        fmt = _lib.mla_parse(name, latent, rope)
    except ValueError as e:
        raise ValueError(f"kvarn: {mc.model} uses {shape}, which {name} cannot hold ({e}); "
                         f"serve it with vLLM's own cache (--kv-cache-dtype auto)") from None
    if vllm_config.device_config.device_type != "cpu":
        raise ValueError(f"kvarn: {name} (MLA records) is served by the CPU kernels only; "
                         f"there are no CUDA kernels for MLA records (include/kvarn/mla.h)")
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None:
        raise ValueError(
            f"kvarn: speculative decoding with {name} (MLA records) is not supported: the "
            f"MLA backend stores every scheduled token as accepted; serve without "
            f"--speculative-config")
    if vllm_config.parallel_config.world_size > 1:
        raise ValueError(f"kvarn: {name} (MLA records) is served on one rank only (no "
                         f"tensor or pipeline parallelism yet)")
    from vllm.logger import init_logger
    init_logger("vllm.kvarn_vllm").warning(
        "kvarn: %s is served in %s records; note that vLLM 0.32's CPU build rotates most of "
        "an MLA model's RoPE query and key pieces wrongly or not at all (its CPU "
        "rotary_embedding kernel on strided views), in its own cache as in this one "
        "(docs/vllm-models.md \"MLA\")", mc.model, name)
    cc.block_size = fmt.tile_tokens
    cc.enable_prefix_caching = False
    sc.enable_chunked_prefill = False
    sc.max_num_batched_tokens = max(sc.max_num_batched_tokens, mc.max_model_len)


def check_mla_name_without_mla(vllm_config) -> None:
    """checks.check_model for a kvarn_mla_* dtype on a model vLLM does not
    run with MLA: ValueError naming what the format is for."""
    mc = vllm_config.model_config
    raise ValueError(
        f"kvarn: {vllm_config.cache_config.cache_dtype} stores MLA latent records "
        f"(DeepSeek-V2/V3-style multi-head latent attention); {mc.model} has no MLA layers "
        f"(vLLM runs it without MLA): use a kvarn format of K/V tiles such as kvarn_k4v2_g128")


# ------------------------------------------------------------------ state

class _Mla:
    """Process-wide state of the MLA layers: the format, the tail pool and
    its slot bookkeeping (shared by the layers: a sequence's tail has the
    same slot in every layer), the plan of the step in flight."""
    fmt = None
    name = None
    latent = rope = G = 0
    record_bytes = 0
    n_slots = 0
    n_layers = 0
    layers: dict = {}          # kv_cache data_ptr -> layer index in the pool
    pool_lat = None            # fp32 [layers, slots, G, latent]
    pool_rope = None           # fp32 [layers, slots, G, rope]
    slot_of: dict = {}         # block id -> slot
    free: list = []
    plan_md = None
    plan = None
    ws = None                  # uint8 workspace (numpy)
    ws_heads = 0
    pool_bytes_budgeted = None


def tail_pool_bytes(n_layers: int, n_slots: int, G: int, latent: int, rope: int) -> int:
    """Bytes of the fp32 tail pool: n_slots slots of G tokens of every layer,
    latent + rope channels of 4 bytes each."""
    return n_layers * n_slots * G * (latent + rope) * 4


def _mla_layer_count(vllm_config) -> int:
    from vllm.config.vllm import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
    return sum(1 for l in layers.values() if is_mla_dtype(getattr(l, "kv_cache_dtype", None)))


def tail_pool(vllm_config) -> dict:
    """The fp32 tail pool of this model and kvarn_mla_* cache dtype at
    vllm_config's max_num_seqs: one slot of G tokens per sequence of every
    MLA layer. Returns bytes, layers, slots, tile (G tokens); what
    reserve_tail_pool takes out of the budget, and what kvarn-vllm-ladder
    counts for each max_num_seqs it tries."""
    latent, rope, _ = mla_dims(vllm_config.model_config)
    G = _lib.mla_parse(vllm_config.cache_config.cache_dtype, latent, rope).tile_tokens
    n_layers = _mla_layer_count(vllm_config)
    slots = vllm_config.scheduler_config.max_num_seqs
    return dict(bytes=tail_pool_bytes(n_layers, slots, G, latent, rope), layers=n_layers,
                slots=slots, tile=G)


def reserve_tail_pool(vllm_config, avail: int, budget_knob: str) -> int:
    """The worker's KV budget (bytes) less the tail pool (worker.py's
    determine_available_memory for MLA records): one slot per sequence
    (max_num_seqs) of every MLA layer. Raises ValueError when the pool
    takes the whole budget."""
    sc = vllm_config.scheduler_config
    tp = tail_pool(vllm_config)
    pool, n_layers = tp["bytes"], tp["layers"]
    if pool >= avail:
        raise ValueError(
            f"kvarn: the fp32 MLA tail pool for max_num_seqs={sc.max_num_seqs} takes "
            f"{pool / 2**30:.2f} GiB, more than the {avail / 2**30:.2f} GiB KV budget; lower "
            f"--max-num-seqs or raise {budget_knob}")
    _Mla.pool_bytes_budgeted = pool
    from vllm.logger import init_logger
    init_logger("vllm.kvarn_vllm").info(
        "kvarn: fp32 MLA tail pool %.1f MiB (%d layers x %d slots of %d tokens) taken out of "
        "the %.1f MiB KV budget", pool / 2**20, n_layers, sc.max_num_seqs, tp["tile"],
        avail / 2**20)
    return avail - pool


def reset_blocks(block_ids) -> None:
    """Blocks vLLM hands out anew (the runner's _zero_block_ids, worker.py):
    a tail slot still keyed by one of them belonged to a sequence that is
    gone; it is freed."""
    if not _Mla.slot_of:
        return
    for b in block_ids:
        s = _Mla.slot_of.pop(int(b), None)
        if s is not None:
            _Mla.free.append(s)


def _live_blocks() -> set:
    """Block ids held by the requests of vLLM's persistent batch (the
    runner the plug-in recorded; one KV-cache group for an MLA model)."""
    from .state import _State
    r = _State.runner
    if r is None:
        return set()
    try:
        bt = r.input_batch.block_table[0]
        n = r.input_batch.num_reqs
        arr, cnt = bt.block_table.np[:n], bt.num_blocks_per_row[:n]
        return {int(x) for i in range(n) for x in arr[i, : int(cnt[i])]}
    except AttributeError:
        return set()


def _alloc_slot(block: int, pinned: set) -> int:
    if not _Mla.free:
        # slots of sequences that finished mid-tile and whose blocks vLLM
        # has not handed out again
        live = _live_blocks() | pinned
        for b in [b for b in _Mla.slot_of if b not in live]:
            _Mla.free.append(_Mla.slot_of.pop(b))
    if not _Mla.free:
        raise _lib.KvarnError(
            f"kvarn: no free MLA tail slot ({_Mla.n_slots} slots, one per sequence: "
            f"max_num_seqs)")
    s = _Mla.free.pop()
    _Mla.slot_of[block] = s
    return s


class _Plan:
    """One step's store operations and decode reads (the same for every
    layer). ops: ("rows", row, block) encode the G fresh rows from `row`
    into the block's record; ("tail", slot, row_a, row_b, off) copy fresh
    rows [row_a, row_b) into slot rows [off, ...); ("seal", slot, block)
    encode the full slot into the block's record. reads[i] for decode
    request i: (record block ids, tail slot or -1, tail tokens)."""

    def __init__(self):
        self.ops, self.reads, self.release = [], [], []


def _make_plan(md) -> _Plan:
    qsl = md.kvarn_qsl
    seq_lens = md.kvarn_seq_lens
    bt = md.kvarn_block_table
    G = _Mla.G
    p = _Plan()
    # every block of this step's requests: a slot keyed by one of them is
    # live whatever the runner's batch says (_alloc_slot's reclaim)
    pinned = {int(b) for b in np.unique(bt)}
    for i in range(md.num_reqs):
        q0, q1 = int(qsl[i]), int(qsl[i + 1])
        L = int(seq_lens[i])
        start = L - (q1 - q0)
        if i >= md.num_decodes and start != 0:
            raise _lib.KvarnError(
                "kvarn: an MLA prefill with tokens already in the cache (chunked prefill or a "
                "prefix-cache hit), which the kvarn MLA backend does not read; both are turned "
                "off at start-up (check_mla_model)")
        for t in range(start // G, (L - 1) // G + 1 if L > start else start // G):
            a, b = max(start, t * G), min(L, (t + 1) * G)
            block = int(bt[i, t])
            full = b == (t + 1) * G
            if a == t * G and full:
                p.ops.append(("rows", q0 + a - start, block))
                continue
            if a == t * G:
                slot = _alloc_slot(block, pinned)
            else:
                slot = _Mla.slot_of.get(block)
                if slot is None:
                    raise _lib.KvarnError(
                        f"kvarn: MLA tail of block {block} not found (tokens {t * G}..{a - 1} "
                        f"of a sequence were stored in an earlier step)")
            p.ops.append(("tail", slot, q0 + a - start, q0 + b - start, a - t * G))
            if full:
                p.ops.append(("seal", slot, block))
                p.release.append(block)
        if i < md.num_decodes:
            n_tiles, n_tail = L // G, L % G
            slot = _Mla.slot_of.get(int(bt[i, n_tiles]), -1) if n_tail else -1
            if n_tail and slot < 0:
                raise _lib.KvarnError(f"kvarn: MLA tail of a decoding sequence not found")
            p.reads.append(([int(bt[i, t]) for t in range(n_tiles)], slot, n_tail))
    return p


def _finish_plan(p: _Plan) -> None:
    """Free the slots sealed this step (after every layer has read them)."""
    for block in p.release:
        s = _Mla.slot_of.pop(block, None)
        if s is not None:
            _Mla.free.append(s)
    p.release = []


# ------------------------------------------------------------------ vLLM classes

class KvarnMLAMetadataBuilder(MLACommonMetadataBuilder):
    """vLLM's MLA metadata, with the step's per-request sequence lengths,
    query offsets and block table kept (CPU copies) for the store plan."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        m = common_attn_metadata
        n = m.num_reqs
        md.kvarn_qsl = m.query_start_loc_cpu[: n + 1].numpy().copy()
        md.kvarn_seq_lens = m.seq_lens[:n].cpu().numpy().copy()
        md.kvarn_block_table = m.block_table_tensor[:n].cpu().numpy()
        return md


class KvarnMLABackend(CPUMLABackend):
    supported_kv_cache_dtypes = mla_dtype_names()

    @staticmethod
    def get_name() -> str:
        return "KVARN_MLA"

    @staticmethod
    def get_impl_cls():
        return KvarnMLAImpl

    @staticmethod
    def get_builder_cls():
        return KvarnMLAMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []   # any latent + rope width the C library serves (checked at start-up)

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return is_mla_dtype(kv_cache_dtype)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [_Mla.G or 128]   # G: the format's tile, once a layer is built

    @classmethod
    def supports_block_size(cls, block_size) -> bool:
        return block_size is None or block_size in (64, 128)

    @classmethod
    def customize_spec(cls, spec):
        """A page of one record per block: state_content_bytes =
        record_bytes / G (uint8; the records of mla.h are whole bytes per
        token for every supported format, checked here)."""
        from dataclasses import replace
        fmt, G, rb = _Mla.fmt, _Mla.G, _Mla.record_bytes
        if fmt is None:
            raise _lib.KvarnError("kvarn: MLA layer spec asked before its layer was built")
        if spec.block_size not in (1, G):
            raise ValueError(f"kvarn: {_Mla.name} stores tiles of {G} tokens, so it needs "
                             f"--block-size {G} (got {spec.block_size})")
        if rb % G:
            raise ValueError(f"kvarn: {_Mla.name}: a record of {rb} bytes is not whole bytes "
                             f"per token of its {G}-token tile")
        return replace(spec, dtype=torch.uint8, state_content_bytes=rb // G)


class KvarnMLAImpl(CPUMLAImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                 sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                 kv_sharing_target_layer_name, **mla_args):
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, **mla_args)
        self.fmt = _lib.mla_parse(kv_cache_dtype, self.kv_lora_rank, self.qk_rope_head_dim)
        if _Mla.fmt is None:
            from vllm.config import get_current_vllm_config
            cfg = get_current_vllm_config()
            _Mla.fmt, _Mla.name = self.fmt, kv_cache_dtype
            _Mla.latent, _Mla.rope = self.kv_lora_rank, self.qk_rope_head_dim
            _Mla.G = self.fmt.tile_tokens
            _Mla.record_bytes = _lib.mla_record_bytes(self.fmt, _Mla.latent, _Mla.rope)
            _Mla.n_slots = cfg.scheduler_config.max_num_seqs
        _Mla.n_layers += 1
        self.layer_index = None

    # ------------------------------------------------------------------ setup
    def _setup(self, kv_cache: torch.Tensor) -> None:
        if kv_cache.device.type != "cpu":
            raise _lib.KvarnError("kvarn: MLA records are served by the CPU kernels only")
        key = kv_cache.data_ptr()
        if key not in _Mla.layers:
            _Mla.layers[key] = len(_Mla.layers)
        self.layer_index = _Mla.layers[key]
        if self.layer_index >= _Mla.n_layers:
            raise _lib.KvarnError(f"kvarn: MLA layer {self.layer_index} has no tail slots "
                                  f"(the pool was sized for {_Mla.n_layers} layers)")
        if kv_cache.stride(0) * kv_cache.element_size() != _Mla.record_bytes \
                and kv_cache.shape[0] > 1:
            raise _lib.KvarnError(
                f"kvarn: MLA cache blocks are {kv_cache.stride(0) * kv_cache.element_size()} "
                f"bytes apart, not one record of {_Mla.record_bytes}")
        if _Mla.pool_lat is None:
            n, G = _Mla.n_slots, _Mla.G
            _Mla.pool_lat = torch.zeros((_Mla.n_layers, n, G, _Mla.latent), dtype=torch.float32)
            _Mla.pool_rope = torch.zeros((_Mla.n_layers, n, G, _Mla.rope), dtype=torch.float32)
            _Mla.free = list(range(n - 1, -1, -1))
            _Mla.slot_of = {}
            from vllm.logger import init_logger
            init_logger("vllm.kvarn_vllm").info(
                "kvarn: MLA cache %s (%d bytes per %d-token record, latent %d + rope %d), "
                "attention kernel %s (calls of 16+ query rows: %s), fp32 tail pool of %d slots "
                "x %d layers", _Mla.name, _Mla.record_bytes, G, _Mla.latent, _Mla.rope,
                _lib.mla_lib().kvarn_mla_attn_kernel_name(_Mla.fmt, _Mla.latent).decode(),
                (_lib.mla_lib().kvarn_mla_attn_matrix_name(_Mla.fmt, _Mla.latent) or b"the same").decode(),
                n, _Mla.n_layers)

    def _workspace(self, n_heads: int) -> int:
        if _Mla.ws is None or _Mla.ws_heads < n_heads:
            nb = _lib.mla_workspace_bytes(_Mla.fmt, _Mla.latent, _Mla.rope, 1, n_heads)
            _Mla.ws = np.zeros(nb, dtype=np.uint8)
            _Mla.ws_heads = n_heads
        return _Mla.ws.ctypes.data

    def _record(self, kv_cache: torch.Tensor, block: int) -> int:
        if not 0 <= block < kv_cache.shape[0]:
            raise _lib.KvarnError(f"kvarn: MLA block {block} outside the cache "
                                  f"({kv_cache.shape[0]} blocks)")
        return kv_cache.data_ptr() + block * kv_cache.stride(0) * kv_cache.element_size()

    # ------------------------------------------------------------------ store
    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype,
                           k_scale) -> None:
        if kv_cache.numel() == 0:
            return
        from vllm.forward_context import get_forward_context
        md = get_forward_context().attn_metadata
        if isinstance(md, dict):
            md = next(iter(md.values()), None)
        if md is None:
            return
        if self.layer_index is None:
            self._setup(kv_cache)
        if _Mla.plan_md is not md:
            if _Mla.plan is not None:
                _finish_plan(_Mla.plan)
            _Mla.plan = _make_plan(md)
            _Mla.plan_md = md
        p = _Mla.plan
        n = md.num_actual_tokens
        lat = kv_c_normed[:n].to(torch.float32).contiguous()
        rope = k_pe[:n].reshape(n, -1).to(torch.float32).contiguous()
        pl, pr = _Mla.pool_lat[self.layer_index], _Mla.pool_rope[self.layer_index]
        ws = self._workspace(1)
        fmt, D, R = _Mla.fmt, _Mla.latent, _Mla.rope
        for op in p.ops:
            if op[0] == "rows":
                _, row, block = op
                _lib.mla_encode(fmt, D, R, lat[row].data_ptr(), rope[row].data_ptr(), ws,
                                self._record(kv_cache, block))
            elif op[0] == "tail":
                _, slot, a, b, off = op
                pl[slot, off:off + b - a] = lat[a:b]
                pr[slot, off:off + b - a] = rope[a:b]
            else:
                _, slot, block = op
                _lib.mla_encode(fmt, D, R, pl[slot].data_ptr(), pr[slot].data_ptr(), ws,
                                self._record(kv_cache, block))

    # ------------------------------------------------------------------ decode
    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        md = attn_metadata
        if isinstance(q, tuple):
            q_lat, q_pe = q
        else:
            q_lat, q_pe = q.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        B, H, _ = q_lat.shape
        if B != md.num_decodes:
            raise _lib.KvarnError(f"kvarn: MLA decode of {B} query rows for {md.num_decodes} "
                                  f"requests (one token per decode step expected)")
        kv_cache = kv_c_and_k_pe_cache.view(torch.uint8)
        if self.layer_index is None:
            self._setup(kv_cache)
        ql = q_lat.to(torch.float32).contiguous()
        qr = q_pe.to(torch.float32).contiguous()
        out = torch.empty((B, H, self.kv_lora_rank), dtype=torch.float32)
        ws = self._workspace(H)
        D, R = _Mla.latent, _Mla.rope
        pl, pr = _Mla.pool_lat[self.layer_index], _Mla.pool_rope[self.layer_index]
        for i, (blocks, slot, n_tail) in enumerate(_Mla.plan.reads):
            recs = [self._record(kv_cache, b) for b in blocks]
            tl = pl[slot].data_ptr() if n_tail else 0
            tr = pr[slot].data_ptr() if n_tail else 0
            _lib.mla_attn(_Mla.fmt, D, R, recs, tl, tr, n_tail, ql[i].data_ptr(),
                          qr[i].data_ptr(), 1, H, 0, self.scale, out[i].data_ptr(), 0, ws)
        return out.to(q_lat.dtype), None

    def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale,
                    output, output_scale=None, *args, **kwargs):
        pre = attn_metadata.prefill
        if pre is not None and pre.chunked_context is not None:
            raise _lib.KvarnError(
                "kvarn: an MLA prefill that reads the cache (chunked prefill or a prefix-cache "
                "hit), which the kvarn MLA backend does not do; both are turned off at start-up")
        return super().forward_mha(q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata,
                                   k_scale, output, output_scale, *args, **kwargs)
