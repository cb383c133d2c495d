"""The plug-in's per-process state of a kvarn cache: the layers in order,
the staging bookkeeping, the plan of the step in flight, the ops; and what
is read from vLLM's model runner (the draft counts of a speculative step,
the blocks of the requests in its batch). One engine per process, as vLLM
runs it: its worker process, or the engine core's own."""
import numpy as np

from .staging import Staging


class _State:
    """Process-wide: the layers in order, the staging bookkeeping, the plan
    of the step in flight, the C thread pool and workspaces."""
    layers: list = []
    hybrid = False      # vLLM's model_config.is_hybrid (Mamba-type layers), set per layer
    staging: Staging | None = None
    plan = None
    plan_meta = None
    ops = None          # ops.CpuOps or ops.CudaOps, by the cache's device
    runner = None
    max_num_seqs = 0
    max_batched_tokens = 0
    draft_tokens = 0    # speculative tokens a step per sequence (0: none)
    dtype_name = None   # the --kv-cache-dtype, set when the backend is chosen
    kv_caches: dict = {}   # layer name -> its cache tensor (the commit log reads them)
    n_impls = 0         # kvarn attention layers built in this process
    n_sliding = 0       # of which with a sliding window (KVARN_SLIDING_WINDOW=quantize)
    aligned_block = 0   # a manager block of several tiles set by layout.align_pages
    pool_size = None    # staging.pool_size as the worker budgeted it (worker.py)
    pool = None         # the staging tensor of every layer (module docstring)
    pool_layers = 0     # the layers it has slots for
    staging_kind = 0    # _lib.STAGING_FP16 / _INT8 / _FP8_E4M3 / _INT4
    exact_commit = False  # Settings.exact_commit: whole prefill tiles from the exact K/V
    loaded: list = []   # (block, sink pages or None) a connector filled, for apply_loaded


def sink_pages(block: int) -> bytes | None:
    """The staged copy of sink tile `block` (a kernel block id) in every
    layer, as bytes: the pool rows l * n_slots + s, l < pool_layers, of its
    sink slot s, each one page (backend._page_shape: int8 staging
    [Hk, G, record bytes] uint8, fp16 [Hk, 2, G, D] int16), back to back in
    layer order. None where the block holds no sink slot (a per-token
    format, no pool yet, not a sink tile, or its slot reclaimed: its record
    then serves the sink, as it does for the engine that wrote it)."""
    st = _State.staging
    if st is None or _State.pool is None or not 0 <= block < len(st.slot_of):
        return None
    s = int(st.slot_of[block])
    if s < 0 or not st.is_sink[s]:
        return None
    import torch
    return b"".join(_State.pool[l * st.n_slots + s].contiguous().view(torch.uint8).numpy()
                    .tobytes() for l in range(_State.pool_layers))


def queue_loaded(block: int, sink: bytes | None = None) -> None:
    """Record that a connector filled kernel block `block` with records
    (and, for a sink tile, its staged copy, sink_pages' bytes of the engine
    that stored it). Applied by apply_loaded at the next step's plan: the
    staging pool is built at the first forward (backend._setup), after the
    first load can have run; the connector's worker runs in the model
    runner's process and thread (offloading/worker.py start_kv_transfers,
    called before the forward), so no lock is needed."""
    _State.loaded.append((int(block), sink))


def apply_loaded() -> None:
    """The queued loads into the staging bookkeeping (Staging.adopt_loaded)
    and each sink copy into a sink slot; backend.do_kv_cache_update calls it
    just before Staging.plan. A sink copy whose size is not one page of
    every layer of this pool (a namespace mismatch, which offload.py's
    directory names prevent) is dropped with a warning: the tile's record
    serves the sink."""
    st = _State.staging
    if not _State.loaded or st is None:
        return
    items, _State.loaded = _State.loaded, []
    stale = sum(1 for b, _ in items if st.slot_of[b] >= 0 or st.sslot_of[b] >= 0)
    st.adopt_loaded([b for b, _ in items])
    from vllm.logger import init_logger
    init_logger("vllm.kvarn_vllm").info(
        "kvarn: %d blocks loaded by a KV connector adopted as records (%d held a previous "
        "user's staging slot, released), %d sink copies", len(items), stale,
        sum(1 for _, d in items if d is not None))
    import torch
    for b, data in items:
        if data is None:
            continue
        rows = [_State.pool[l * st.n_slots] for l in range(_State.pool_layers)]
        want = sum(r.numel() * r.element_size() for r in rows)
        if len(data) != want:
            from vllm.logger import init_logger
            init_logger("vllm.kvarn_vllm").warning(
                "kvarn: the loaded sink copy of block %d has %d bytes, not %d (one staging "
                "page of %d layers): dropped, its record serves the sink", b, len(data), want,
                len(rows))
            continue
        s = st.take_sink_slot(b)
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        off = 0
        for l in range(_State.pool_layers):
            dst = _State.pool[l * st.n_slots + s].view(torch.uint8)
            n = dst.numel()
            dst.copy_(src[off:off + n].view(dst.shape))
            off += n


def step_draft_counts(num_reqs: int, query_start_loc_cpu) -> np.ndarray | None:
    """int32 [num_reqs]: the draft tokens at the end of each request's
    queries this step, as the model runner handed them to
    _calc_spec_decode_metadata (worker.py stashes them); None where the step
    has no speculation. The stash is used only when its cumulative token
    counts are this step's query_start_loc, so a stale one is never read."""
    r = _State.runner
    st = getattr(r, "kvarn_drafts", None) if r is not None else None
    if st is None:
        return None
    nd, cu = st
    qsl = np.asarray(query_start_loc_cpu)[1:num_reqs + 1]
    if len(nd) < num_reqs or len(cu) < num_reqs or not np.array_equal(cu[:num_reqs], qsl):
        return None
    return np.asarray(nd[:num_reqs], dtype=np.int32)


def _kvarn_attn_group(runner):
    """The model runner's attention group of the kvarn layers (a hybrid
    model has others, in vLLM's own cache), or None."""
    for groups in getattr(runner, "attn_groups", None) or []:
        for g in groups:
            if g.backend.get_name() == "KVARN":
                return g
    return None


def kernel_block_ids(runner, block_ids) -> list:
    """vLLM's block ids (the KV-cache manager's) as block ids of the kvarn
    layers' cache tensor. Where vLLM 0.32 gives the manager blocks of several
    tiles (its page alignment when layers of vLLM's own cache share the block
    pool, docs/vllm-models.md "Sliding-window layers"), each is split into kernel
    blocks of one tile (get_supported_kernel_block_sizes): manager block b
    is kernel blocks b * stride + j, j < n, as the attention metadata's block
    table has them (AttentionGroup.map_to_kernel_block_table)."""
    g = _kvarn_attn_group(runner)
    if g is None or g.kernel_block_size is None:
        return [int(b) for b in block_ids]
    n = g.kv_cache_spec.block_size // g.kernel_block_size
    s = g.kernel_block_stride or n
    return [int(b) * s + j for b in block_ids for j in range(n)]


def _live_blocks() -> set:
    """Block ids (the kvarn cache's) held by the requests in vLLM's
    persistent batch (running, scheduled this step or not)."""
    r = _State.runner
    if r is None:
        return set()
    try:
        ib = r.input_batch
        g = _kvarn_attn_group(r)
        bt = ib.block_table[0 if g is None else g.kv_cache_group_id]
        n = ib.num_reqs
        arr = bt.block_table.np[:n]
        cnt = bt.num_blocks_per_row[:n]
        out = []
        for i in range(n):
            out.extend(int(x) for x in arr[i, : int(cnt[i])])
        return set(kernel_block_ids(r, out))
    except AttributeError:
        return set()
