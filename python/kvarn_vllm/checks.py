"""Front-end checks of a model and configuration for a kvarn cache dtype, in
the process that calls LLM(...) or starts the server, before any engine
process starts (platform.py's check_and_update_config calls check_model):
what the kvarn backend refuses raises here with the reason and what to do
(the backend's own checks in the worker stay, but vLLM reports a worker's
error only as "Engine core initialization failed")."""
from .settings import SLIDING_ENV, Settings, tile_settings_set

SLIDING_MARK = "sliding_window"   # vLLM's kv_cache_dtype_skip_layers pattern
SLIDING_ADDED = "kvarn_sliding_added"   # additional_config: check_model added SLIDING_MARK


# Model types whose attention adds a bias to q, k and v by construction
# (transformers' Qwen2 family has no attention_bias setting: bias=True in
# its q/k/v projections); other configs say so with attention_bias.
# check_model passes the text config: Qwen2-VL's and Qwen2.5-VL's are
# qwen2_vl_text and qwen2_5_vl_text (transformers' Qwen2VLTextConfig), the
# outer types kept for a caller that passes the whole config.
_QKV_BIAS_TYPES = ("qwen2", "qwen2_moe", "qwen2_vl", "qwen2_vl_text", "qwen2_5_vl",
                   "qwen2_5_vl_text")


def has_value_bias(hf_config) -> bool:
    """Whether the model's v projection adds a bias (hf_config: the text
    config transformers reads): attention_bias true, or a model type of
    _QKV_BIAS_TYPES. A value bias shifts every value of a KV head by the
    same vector, which the centred formats store apart (docs/kvarn-centred.md)."""
    return bool(getattr(hf_config, "attention_bias", False)) or \
        getattr(hf_config, "model_type", "") in _QKV_BIAS_TYPES


def _check_linear_attention(mc, hf, device_type: str) -> None:
    """Hybrid linear attention (Qwen3-Next, Qwen3.5: Gated DeltaNet layers,
    layer_types "linear_attention"): their recurrent state stays in vLLM's
    own cache, but vLLM 0.32's CPU build runs those layers in bfloat16 only
    (vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py asserts "CPU
    GDN attention requires BF16." at the first step, with any cache dtype):
    any other --dtype is refused here, before an engine starts, naming it."""
    import torch
    kinds = getattr(hf, "layer_types", None) or []
    if device_type == "cpu" and "linear_attention" in kinds and mc.dtype != torch.bfloat16:
        raise ValueError(
            f"kvarn: {mc.model} has linear-attention (Gated DeltaNet) layers, which vLLM's "
            f"CPU build runs in bfloat16 only (its own error at the first step: 'CPU GDN "
            f"attention requires BF16.'); serve it with --dtype bfloat16 "
            f"(got {str(mc.dtype).removeprefix('torch.')})")


def check_model(vllm_config, settings: Settings = None) -> None:
    """Front-end checks, in the process that calls LLM(...) or starts the
    server, before any engine process starts: what the model needs that the
    kvarn backend refuses raises here with the reason and what to do (the
    backend's own checks in the worker stay, but vLLM reports a worker's
    error only as "Engine core initialization failed"). Also applies
    KVARN_SLIDING_WINDOW: with "vllm" the sliding-window layers are listed in
    vLLM's kv_cache_dtype_skip_layers (0.32's per-layer cache dtype), so they
    get vLLM's own cache and backend."""
    from . import _lib
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    name = cc.cache_dtype
    if getattr(mc, "use_mla", False):
        from .mla_backend import check_mla_model
        check_mla_model(vllm_config)   # MLA: its own checks (mla_backend.py)
        return
    if _lib.is_mla_dtype(name):
        from .mla_backend import check_mla_name_without_mla
        check_mla_name_without_mla(vllm_config)
    tile_set = tile_settings_set() if _lib.is_per_token_dtype(name) else []
    if tile_set:
        raise ValueError(
            f"kvarn: {name} writes each token's record at once (no staging pool, sink or "
            f"commit), so {', '.join(tile_set)} does not apply to it; unset it "
            f"(it applies to the KVarN formats, e.g. kvarn_k4v2_g128)")
    policy = (settings or Settings.of(vllm_config)).sliding_window
    dims = kvarn_head_dims(mc, policy)
    for d in dims:
        try:
            _lib.parse_format(name, d)
        except ValueError as e:
            try:   # a per-token format takes it (Phi-3's 96): name that step
                _lib.parse_format("kvarn_int8", d)
                alt = "with a per-token format (e.g. --kv-cache-dtype kvarn_int8) or "
            except ValueError:
                alt = ""
            raise ValueError(
                f"kvarn: {mc.model} has head_dim {d}, which {name} cannot "
                f"store ({e}); serve it {alt}with one of vLLM's own cache dtypes (e.g. "
                f"--kv-cache-dtype auto)") from None
    if len(dims) > 1:
        # the tile formats' staging pool has one page shape; a per-token
        # format's pages (Hk x block x (D + meta) bytes) at two head_dims do
        # not divide one another as vLLM's page unification needs
        why = ("the kvarn staging pool has one page shape" if not _lib.is_per_token_dtype(name)
               else "their record pages would not divide one another as vLLM's one page "
               "size needs")
        raise ValueError(
            f"kvarn: the layers of {mc.model} that {name} would store have head_dims "
            f"{', '.join(map(str, dims))}; {why}, so "
            f"they must share one head_dim: {SLIDING_ENV}=vllm (the default) keeps the "
            f"sliding-window layers in vLLM's own cache (docs/vllm-models.md), or serve it "
            f"with one of vLLM's own cache dtypes (e.g. --kv-cache-dtype auto)")
    _place_proposer_cache(vllm_config)
    _check_hybrid_speculation(vllm_config)
    _check_draft_count(vllm_config)
    hf = mc.hf_text_config
    _check_linear_attention(mc, hf, vllm_config.device_config.device_type)
    fmt = _lib.parse_format(name, dims[0])
    if fmt.centred and vllm_config.device_config.device_type == "cuda":
        raise ValueError(
            f"kvarn: {name} (mean-centred values) is served by the CPU kernels only; the "
            f"CUDA backend does not build it yet: use {name[:-1]}")
    if fmt.kind == _lib.KIND_KVARN and not fmt.centred and has_value_bias(hf):
        from vllm.logger import init_logger
        if vllm_config.device_config.device_type == "cuda":  # the centred ones are refused there
            init_logger("vllm.kvarn_vllm").warning(
                "kvarn: %s adds a bias to its values, which %s quantizes with the rest; the "
                "mean-centred %sc, which stores each tile's value means apart, is served on "
                "CPU only (docs/kvarn-centred.md)", mc.model, name, name)
        else:
            init_logger("vllm.kvarn_vllm").warning(
                "kvarn: %s adds a bias to its values, which %s quantizes with the rest; the "
                "mean-centred %sc stores each tile's value means apart (on a Qwen2-shaped "
                "model, docs/kvarn-centred.md: KL 18x lower for about 2%% more bytes): "
                "--kv-cache-dtype %sc", mc.model, name, name, name)
    shared = kv_shared_kvarn_layers(mc, policy)
    if shared:
        raise ValueError(
            f"kvarn: {mc.model} reads the KV cache of earlier layers in its last "
            f"{hf.num_kv_shared_layers} layers (num_kv_shared_layers), {len(shared)} of them "
            f"in {name} (layers {', '.join(map(str, shared))}), which the kvarn backend does "
            f"not do; serve it with one of vLLM's own cache dtypes (e.g. --kv-cache-dtype auto)")
    cap = getattr(hf, "attn_logit_softcapping", None)
    if cap:
        raise ValueError(
            f"kvarn: {mc.model} soft-caps its attention logits (attn_logit_softcapping="
            f"{cap}), which the kvarn attention kernels do not do; serve it with one of "
            f"vLLM's own cache dtypes (e.g. --kv-cache-dtype auto)")
    if policy == "vllm" and mc.get_sliding_window() is not None \
            and SLIDING_MARK not in cc.kv_cache_dtype_skip_layers:
        cc.kv_cache_dtype_skip_layers = sorted(set(cc.kv_cache_dtype_skip_layers)
                                               | {SLIDING_MARK})
        vllm_config.additional_config[SLIDING_ADDED] = True


def _place_proposer_cache(vllm_config) -> None:
    """Model-based speculation (spec.SPEC_MODEL_METHODS: a draft model,
    an EAGLE / EAGLE-3 head, MTP layers): where speculative_config.kv_cache_dtype is
    unset (vLLM's default: the proposer inherits --kv-cache-dtype), set it
    to "auto", so the proposer's layers keep vLLM's own cache and attend
    through vLLM's CPU backend (docs/vllm-models.md "Model-based
    speculation"); an explicit kvarn name there, and any other method, is
    refused by spec.check_speculative with the reason, here before an
    engine starts."""
    from .spec import SPEC_MODEL_METHODS, check_speculative
    sc = vllm_config.speculative_config
    if sc is not None and sc.method in SPEC_MODEL_METHODS and sc.kv_cache_dtype is None:
        sc.kv_cache_dtype = "auto"
        from vllm.logger import init_logger
        init_logger("vllm.kvarn_vllm").info(
            "kvarn: speculative method '%s': the proposer's layers keep vLLM's own cache "
            "(speculative_config kv_cache_dtype='auto'), the target's are in %s",
            sc.method, vllm_config.cache_config.cache_dtype)
    check_speculative(vllm_config)


def _check_hybrid_speculation(vllm_config) -> None:
    """Speculative decoding (any method) on a hybrid model (Mamba-type
    layers: Qwen3-Next's Gated DeltaNet) with prefix caching: vLLM 0.32's
    CPU build fails at the first step with its own cache too (mamba_utils'
    precopy_mamba_align_fused_kernel is a Triton kernel the CPU build lacks:
    "TypeError: 'function' object is not subscriptable"; tried with 'ngram'
    and 'mtp' on a Qwen3-Next shape, docs/vllm-models.md): refused here,
    naming --no-enable-prefix-caching, which runs."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    if vllm_config.speculative_config is not None and mc.is_hybrid \
            and cc.enable_prefix_caching and vllm_config.device_config.device_type == "cpu":
        raise ValueError(
            f"kvarn: speculative decoding on {mc.model} (hybrid: linear-attention / "
            f"Mamba-type layers) with prefix caching fails in vLLM 0.32's CPU build itself "
            f"(with any cache dtype, at the first step: \"TypeError: 'function' object is not "
            f"subscriptable\" from mamba_utils' Triton-only precopy_mamba_align_fused_kernel); "
            f"turn prefix caching off: --no-enable-prefix-caching (LLM(..., "
            f"enable_prefix_caching=False))")


def _check_draft_count(vllm_config) -> None:
    """num_speculative_tokens (any method) above vLLM 0.32's rejection
    sampler limit (vllm/v1/sample/rejection_sampler.py MAX_SPEC_LEN, 128):
    the engine starts, then fails at the first step with a bare
    AssertionError, with its own cache too (tried: draft_model with 130
    drafts, kvarn and --kv-cache-dtype auto; docs/vllm-models.md). Refused
    here with the limit; 128 drafts (k = G) run with kvarn."""
    from vllm.v1.sample.rejection_sampler import MAX_SPEC_LEN
    from .spec import draft_tokens
    k = draft_tokens(vllm_config)
    if k > MAX_SPEC_LEN:
        raise ValueError(
            f"kvarn: num_speculative_tokens {k} is above vLLM 0.32's limit of {MAX_SPEC_LEN} "
            f"draft tokens a step (its rejection sampler's MAX_SPEC_LEN: the engine would fail "
            f"at the first step, with any cache dtype); use at most {MAX_SPEC_LEN}")


def kvarn_head_dims(mc, policy: str) -> list:
    """The head_dims, sorted, of the layers of model config mc that the
    kvarn format would store under KVARN_SLIDING_WINDOW=policy, from vLLM
    0.32's per-layer architecture config (model_arch_config[i] where layers
    differ: Gemma-4's global layers at global_head_dim 512, its
    sliding-window ones at 256). With "vllm", the layers that
    hf_text_config.layer_types marks "sliding_attention" keep vLLM's cache
    and are left out (unless that leaves none: then vLLM's cache everywhere,
    and the head_dims of all layers are checked as before)."""
    ac = mc.model_arch_config
    if not ac.per_layer_overrides:
        return [mc.get_head_size()]
    n = mc.get_total_num_hidden_layers()
    dims = [ac[i].head_size for i in range(n)]
    types = getattr(mc.hf_text_config, "layer_types", None) or []
    if policy == "vllm" and mc.get_sliding_window() is not None and len(types) == n:
        dims = [d for d, t in zip(dims, types) if t != "sliding_attention"] or dims
    return sorted(set(dims))


def kv_shared_kvarn_layers(mc, policy: str) -> list:
    """Indices of the layers that would be in the kvarn format under
    KVARN_SLIDING_WINDOW=policy and read another layer's KV cache: the last
    hf_text_config.num_kv_shared_layers layers (a field of the Gemma-3n and
    Gemma-4 configs; vLLM gives those layers kv_sharing_target_layer_name),
    less the sliding-window ones with "vllm"."""
    hf = mc.hf_text_config
    n, k = hf.num_hidden_layers, int(getattr(hf, "num_kv_shared_layers", 0) or 0)
    types = getattr(hf, "layer_types", None) or []
    keep_sliding = policy == "vllm" and mc.get_sliding_window() is not None
    return [i for i in range(n - k, n)
            if not (keep_sliding and i < len(types) and types[i] == "sliding_attention")]


# The KV connectors served with kvarn cache dtypes (docs/vllm-connectors.md):
# (kv_connector, what else must match in the transfer config) -> the name
# given in messages. Any other connector moves a kvarn page without the
# plug-in's staging bookkeeping (loaded blocks adopted as records, sink
# copies) and untested: vLLM's NixlConnector on CPU moved kvarn_k4v2_g128
# pages of a prompt into the decode instance's blocks one block off (the
# kvarn scheduler cut the hit to whole tiles; NIXL kept the tail of the
# prefill instance's blocks), with no error and other tokens.
SERVED_CONNECTORS = (
    ("OffloadingConnector", "spec_module_path", "kvarn_vllm.offload",
     "OffloadingConnector with spec KvarnFileSpec (kvarn_vllm.offload: file tier, "
     "prefill/decode)"),
    ("KvarnLMCacheMPConnector", "kv_connector_module_path", "kvarn_vllm.lmcache_mp",
     "KvarnLMCacheMPConnector (kvarn_vllm.lmcache_mp: LMCache's multiprocess server)"),
)


def check_kv_connector(vllm_config) -> None:
    """Raise ValueError where the engine's kv_transfer_config names a KV
    connector not served with its kvarn cache dtype (SERVED_CONNECTORS),
    naming it and the served ones. vllm_config: the engine's VllmConfig
    with a kvarn cache dtype; no transfer config is fine."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    name = getattr(ktc, "kv_connector", None)
    if not name:
        return
    extra = getattr(ktc, "kv_connector_extra_config", None) or {}
    for conn, key, want, _ in SERVED_CONNECTORS:
        got = extra.get(key) if key != "kv_connector_module_path" else \
            getattr(ktc, "kv_connector_module_path", None)
        if name == conn and got == want:
            return
    raise ValueError(
        f"kvarn: the KV connector {name} is not served with --kv-cache-dtype "
        f"{vllm_config.cache_config.cache_dtype} (it would move kvarn pages without the "
        "plug-in's staging bookkeeping; vLLM's NixlConnector on CPU moved them misaligned, "
        "silently giving other tokens); served: "
        + "; ".join(s[3] for s in SERVED_CONNECTORS)
        + " (docs/vllm-connectors.md), or use one of vLLM's own cache dtypes with it")
