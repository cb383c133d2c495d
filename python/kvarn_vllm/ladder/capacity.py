"""Capacity as vLLM computes it for the --budget KV budget, in the engine's
process: bytes per token, KV tokens and requests that fit, the plug-in's
staging pool (or MLA tail pool) taken out first."""


def _blocks_per_request(vllm_config, groups, ctx: int) -> int:
    """Blocks one request of ctx tokens holds, summed over the KV-cache
    groups (each group's block table draws on the one pool), as vLLM 0.32's
    get_max_concurrency_for_kv_cache_config counts them with max_model_len
    ctx: a full-attention group ceil(ctx / its block size), a
    sliding-window group the blocks its window and a step's tokens span."""
    mc = vllm_config.model_config
    old = mc.max_model_len
    try:
        mc.max_model_len = ctx
        return sum(-(-g.kv_cache_spec.max_memory_usage_bytes(vllm_config)
                     // g.kv_cache_spec.page_size_bytes) for g in groups)
    finally:
        mc.max_model_len = old


def _capacity(orig, vllm_config, specs, job_cfg) -> dict:
    """What vLLM computes for a KV budget of job_cfg["budget"] bytes, in
    the engine's process (called from get_kv_cache_configs, with the
    model's KV cache specs): bytes per token, block size, and per
    max_num_seqs n the blocks that vLLM's own get_kv_cache_configs gives
    for the budget less the plug-in's pool for n sequences, what the
    plug-in's worker takes out: the staging pool of the K/V formats
    (layout.staging_pool), the fp32 tail pool of the MLA record formats
    (mla_backend.tail_pool at n, as reserve_tail_pool sizes it)."""
    from .. import _lib
    cc, sc = vllm_config.cache_config, vllm_config.scheduler_config
    kvarn = _lib.is_kvarn_dtype(cc.cache_dtype)
    mla = kvarn and _lib.is_mla_dtype(cc.cache_dtype)
    layer_specs = list(specs[0].values())
    bpt = sum(s.page_size_bytes / s.block_size for s in layer_specs)

    ctx, budget = job_cfg["ctx"], job_cfg["budget"]

    def blocks(n: int, budget: int) -> tuple:
        """(blocks, pool bytes, block size, blocks a request of ctx tokens
        holds, KV-cache groups, refusal) at max_num_seqs n."""
        old = sc.max_num_seqs
        try:
            sc.max_num_seqs = n
            pool = 0
            if mla:
                from ..mla_backend import tail_pool
                pool = tail_pool(vllm_config)["bytes"]
            elif kvarn:
                from ..layout import staging_pool
                pool = staging_pool(vllm_config, budget, "cpu")["bytes"]
            if pool >= budget:
                what = "MLA tail pool" if mla else "staging pool"
                return 0, pool, None, None, 0, (f"the {what} for max_num_seqs={n} "
                                                f"({pool} bytes) fills the budget")
            try:
                cfgs = orig(vllm_config, specs, [budget - pool] * len(specs))
            except ValueError as e:    # vLLM: not enough for one max_model_len request
                return 0, pool, None, None, 0, str(e).split("\n")[0]
            nb = min(c.num_blocks for c in cfgs)
            groups = cfgs[0].kv_cache_groups
            bs = min(g.kv_cache_spec.block_size for g in groups)
            return nb, pool, bs, _blocks_per_request(vllm_config, groups, ctx), len(groups), None
        finally:
            sc.max_num_seqs = old

    def fit(n: int) -> tuple:
        nb, pool, bs, per_req, ng, why = blocks(n, budget)
        if not nb:
            return 0, nb, pool, bs, per_req, ng, why
        return max(0, nb - 1) // per_req, nb, pool, bs, per_req, ng, why   # one null block

    want = job_cfg.get("max_num_seqs")
    if want:
        n = want
    else:   # the largest n whose pool leaves room for n requests
        hi = fit(1)[0]
        lo, n = 1, 1 if hi >= 1 else 0
        while lo <= hi:
            mid = (lo + hi) // 2
            if fit(mid)[0] >= mid:
                n, lo = mid, mid + 1
            else:
                hi = mid - 1
    f, nb, pool, bs, per_req, ng, why = fit(max(n, 1))
    if bs is None:
        kv_tokens = None
    elif ng <= 1:
        kv_tokens = nb * bs
    else:     # several groups share the blocks: vLLM's own figure at ctx
        kv_tokens = nb * ctx // per_req
    out = dict(bytes_per_token=bpt, budget_blocks=nb, block_size=bs,
               max_num_batched_tokens=sc.max_num_batched_tokens, kv_cache_groups=ng,
               blocks_per_request=per_req, kv_tokens=kv_tokens, pool_bytes=pool,
               max_num_seqs=n, requests_fit=min(f, n),
               capped=bool(want) and f > want, refusal=why)
    # the engine's own budget and max_num_seqs, to check against what the
    # engine then reports
    out["engine_blocks_predicted"] = blocks(sc.max_num_seqs, job_cfg["engine_kv"])[0]
    return out


