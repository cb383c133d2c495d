"""Where a kvarn cache's pages go: which layers are in the kvarn format, the
pages of kvarn layers beside layers in vLLM's own cache (sliding-window
layers, KVARN_SLIDING_WINDOW=vllm), and the staging pool the worker takes
out of the KV budget."""
from .checks import SLIDING_ADDED, SLIDING_MARK
from .settings import SLIDING_ENV, Settings


def kvarn_layer_names(vllm_config) -> list:
    """The attention layers that store their cache in the kvarn format (the
    others were given vLLM's own cache by kv_cache_dtype_skip_layers)."""
    from vllm.config.vllm import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from ._lib import is_kvarn_dtype
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


def settle_sliding_layers(vllm_config, align: bool) -> None:
    """The platform's update_block_size_for_backend, run in the worker once
    the model is built: where the kvarn dtype has layers in vLLM's own cache,
    vLLM 0.32 aligns the pages of both kinds (_align_heterogeneous_kv_block_size;
    align: the platform leaves that to us, as vLLM 0.32's CPU platform does,
    align_pages); where check_model's entry in kv_cache_dtype_skip_layers
    matched no layer, or matched every layer, there is nothing to align and
    the entry is taken out again (the alignment would otherwise still run)."""
    cc = vllm_config.cache_config
    extra = vllm_config.additional_config
    if not (isinstance(extra, dict) and extra.get(SLIDING_ADDED)):
        return
    from vllm.config.vllm import get_layers_from_vllm_config
    from vllm.logger import init_logger
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    n_all = len(get_layers_from_vllm_config(vllm_config, AttentionLayerBase))
    n_kv = len(kvarn_layer_names(vllm_config))
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
    elif align:
        align_pages(vllm_config, log)


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
    from .state import _State
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    if mc.is_hybrid:
        return
    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
    kv_names = set(kvarn_layer_names(vllm_config))
    fmt = _lib.parse_format(cc.cache_dtype)
    # tokens of a kvarn page: the tile, or vLLM's block for a per-token
    # format (whose records are of one token: tile_tokens 1)
    G = _lib.page_tokens(fmt, cc.block_size)
    kv_tok, own_tok = 0, 0
    for name, layer in layers.items():
        hk, d = int(layer.num_kv_heads), int(layer.head_size)
        if name in kv_names:
            rb = _lib.record_bytes(_lib.parse_format(cc.cache_dtype, d), d)
            kv_tok = max(kv_tok, hk * (rb // fmt.tile_tokens))
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
            f = _lib.parse_format(cc.cache_dtype, d)
            rb = _lib.record_bytes(f, d)
            s = spec(torch.uint8, m * G, state_content_bytes=rb // f.tile_tokens)
        else:
            s = spec(layer.kv_cache_torch_dtype, G,
                     page_size_padded=m * G * kv_tok if m > 1 else None)
        mine += s.max_memory_usage_bytes(vllm_config)
    return mine, own


def staging_pool(vllm_config, budget: int = 0, device_type: str = "cpu") -> dict:
    """The staging pool for this model, max_num_seqs, max_num_batched_tokens
    and KV budget (bytes; 0: no slots <= blocks bound): staging.pool_size
    over the kvarn layers (layers in vLLM's cache have no pool), with the
    staging of the engine's settings (Settings.staging_kind). bytes is what the worker
    takes out of the KV budget; {"bytes": 0} without kvarn layers."""
    from . import _lib
    from .spec import draft_tokens
    from .staging import pool_size
    mc = vllm_config.model_config
    sc = vllm_config.scheduler_config
    name = vllm_config.cache_config.cache_dtype
    if _lib.is_per_token_dtype(name):
        # per-token records are written at each token's slot as it comes:
        # nothing is staged, nothing committed (docs/vllm.md "Per-token formats")
        return {"bytes": 0}
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
    settings = Settings.of(vllm_config)
    tiles, partial = settings.sink(fmt.tile_tokens)
    kind = settings.staging_kind(device_type)
    # one block of every kvarn layer: the most blocks the budget could hold
    # is budget / (that), so the bound holds for any share of the budget the
    # other layers take
    block = n_layers * hk * _lib.record_bytes(fmt, D)
    return pool_size(fmt, n_layers, hk, D, sc.max_num_seqs, tiles, partial,
                     draft_tokens(vllm_config), kind, sc.max_num_batched_tokens, budget, block)
