"""kvarn's pages through LMCache's multiprocess (MP) server: a subclass of
LMCache 0.5.6's vLLM connector (lmcache/integration/vllm/
lmcache_mp_connector.py LMCacheMPConnector), loaded with

    kv_transfer_config={"kv_connector": "KvarnLMCacheMPConnector",
                        "kv_connector_module_path": "kvarn_vllm.lmcache_mp",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                                      "lmcache.mp.port": 5555}}

LMCache moves vLLM's KV tensor bytes (for a kvarn cache: the records), so
a stored token costs the format's bytes. What the subclass adds
(docs/vllm-connectors.md "LMCache"):

- the key: LMCache keys an entry by model name and tokens only
  (get_dcp_decorated_model_name, lmcache_mp_connector.py:305): an engine of
  another cache dtype on the same server would hit entries of another byte
  layout and its load crash vLLM's engine core. The name the adapters key
  with (their model_name) gets the cache dtype, the model dtype, the block
  size and, for kvarn dtypes, the kvarn settings (cache_name);
- loaded blocks: the worker hands every block a retrieve fills (not those
  of vLLM's own prefix cache that the retrieve skips) to
  state.queue_loaded, so the staging bookkeeping adopts them as committed
  records (Staging.adopt_loaded) as it does for the file tier (offload.py);
  a block whose load failed is reset (Staging.reset_blocks);
- whole-prompt hits of a KVarN tile format: LMCache reports one token less
  than a whole-prompt hit itself (so scheduler.whole_tile_hits, which looks
  for a hit reaching the prompt's end, does not see it); the hit is cut back
  to the last whole tile before the prompt's end, the retrieve shortened to
  match and the lookup locks of the chunks not loaded freed;
- sink tiles refused (check_config): a sink tile is attended from a staged
  copy kept outside vLLM's KV tensor (the staging pool), which LMCache does
  not move.
"""
import math

from lmcache.integration.vllm.lmcache_mp_connector import (LMCacheMPConnector,
                                                           get_dcp_decorated_model_name)
from vllm.logger import init_logger

from ._lib import is_kvarn_dtype
from .lmcache_config import _tile_format, check_config, llvmlite_vars_fix  # noqa: F401


llvmlite_vars_fix()

log = init_logger("vllm.kvarn_vllm")

NAME_SEPARATOR = "##kvarn-"
NAME_VERSION = 1      # of cache_name's fields


def cache_name(vllm_config, kv_cache_config=None) -> str:
    """The model name LMCache keys this engine's entries with: LMCache's
    own (model path, with its DCP decoration) + NAME_SEPARATOR + the fields
    that decide a block's bytes: name version, cache dtype, model dtype,
    block size, and for kvarn dtypes offload.settings_fields (staging,
    sink tiles, prefill commit, sliding window)."""
    base = get_dcp_decorated_model_name(vllm_config, kv_cache_config)
    cc = vllm_config.cache_config
    mdtype = str(vllm_config.model_config.dtype).replace("torch.", "")
    parts = [f"v{NAME_VERSION}", str(cc.cache_dtype), mdtype, f"b{cc.block_size}"]
    if is_kvarn_dtype(cc.cache_dtype):
        from .offload import settings_fields
        parts += settings_fields(vllm_config)
    return base + NAME_SEPARATOR + "_".join(parts)


class KvarnLMCacheMPConnector(LMCacheMPConnector):
    """LMCacheMPConnector for a kvarn cache (module docstring); any cache
    dtype is served (for vLLM's own the subclass only adds the key's
    fields)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        check_config(vllm_config)
        super().__init__(vllm_config, role, kv_cache_config)
        # the adapters key every lookup, store and retrieve with their
        # model_name (vllm_multi_process_adapter.py _create_key,
        # transfer_ctx.register at register_kv_caches, which comes later);
        # the constructor only used it for a metrics label
        name = cache_name(vllm_config, getattr(self, "_kv_cache_config", None))
        for attr in ("scheduler_adapter", "worker_adapter"):
            ad = getattr(self, attr, None)
            if ad is not None:
                ad.model_name = name
        self.kvarn_cache_name = name
        fmt = _tile_format(vllm_config)
        self._tile_tokens = fmt.tile_tokens if fmt is not None else 0
        self.kvarn_loaded_blocks = 0
        log.info("kvarn: LMCache MP connector (%s), cache name %s%s", role, name,
                 ", KVarN tiles: loaded blocks adopted as records" if fmt is not None else "")

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        G = self._tile_tokens
        if not G or not n:
            return n, load_async
        end = num_computed_tokens + n
        last = request.num_tokens - 1      # the token vLLM recomputes on a whole hit
        if end < last or last % G == 0:
            return n, load_async
        # a whole-prompt hit whose recomputed last token lies inside a loaded
        # tile: that query would read its own tile from the record where a cold
        # run reads the tile's tokens from the staging pool
        # (scheduler.whole_tile_hits); load up to the last whole tile only
        # (without this cut, tests/vllm/test_lmcache.py's Q loaded 383 tokens:
        # same greedy tokens, logprobs up to 0.069 nat off the cold run; with it 0)
        tracker = self._get_request_tracker(request.request_id)
        chunk = self.scheduler_adapter.lmcache_tokens_per_chunk
        keep = last // G * G // chunk * chunk
        hit = tracker.num_lmcache_hit_tokens
        if keep < hit:
            tracker.num_lmcache_hit_tokens = keep
            # the lookup locked chunks [0, hit); those past keep are never
            # retrieved now, so their locks are freed here
            self.scheduler_adapter.free_lookup_locks(
                token_ids=tracker.get_token_ids(), start=keep, end=hit,
                request_id=request.request_id, cache_salt=tracker.cache_salt,
                request_configs=tracker.request_configs)
        n = max(0, keep - num_computed_tokens)
        log.debug("kvarn: whole-prompt LMCache hit of request %s cut back to %d tokens "
                  "(last tile recomputed)", request.request_id, keep)
        return n, n > 0

    # ---- worker side ----

    def start_load_kv(self, forward_context, **kwargs):
        super().start_load_kv(forward_context, **kwargs)
        if not self._tile_tokens:
            return
        from .state import _State, kernel_block_ids, queue_loaded
        bs = self._vllm_config.cache_config.block_size
        n = 0
        for meta in self._get_connector_metadata().requests:
            if meta.direction != "RETRIEVE":
                continue
            op = meta.op
            ids = op.block_ids
            if ids and isinstance(ids[0], (list, tuple)):
                ids = ids[0]            # one KV-cache group (a kvarn model has one)
            # blocks of the first skip_first_n_tokens are vLLM's own prefix
            # cache's, shared and not written by the retrieve
            first = math.ceil(op.skip_first_n_tokens / bs) if op.skip_first_n_tokens > 0 else 0
            for b in kernel_block_ids(_State.runner, list(ids)[first:]):
                queue_loaded(b, None)
                n += 1
        self.kvarn_loaded_blocks += n

    def get_block_ids_with_load_errors(self):
        errors = super().get_block_ids_with_load_errors()
        if errors and self._tile_tokens:
            from .state import _State, kernel_block_ids
            bad = set(kernel_block_ids(_State.runner, sorted(errors)))
            _State.loaded = [(b, s) for b, s in _State.loaded if b not in bad]
            if _State.staging is not None:
                _State.staging.reset_blocks(sorted(bad))
            log.warning("kvarn: %d blocks failed to load from LMCache: reset in the staging "
                        "bookkeeping (recomputed)", len(bad))
        return errors
