"""The kvarn scheduler classes, which vLLM builds through its public hook
(scheduler_config.scheduler_cls, set by platform.py for a kvarn cache
dtype): vLLM's Scheduler (or AsyncScheduler) given a KV-cache configuration
whose needs_kv_cache_zeroing is always true.

vLLM 0.32 reports the blocks it hands out (new_block_ids_to_zero, then the
runner's _zero_block_ids) only where its KVCacheConfig needs_kv_cache_zeroing
(Mamba layers, mixed precisions); for a kvarn cache the plug-in needs them
always: a block freed by one request and handed to another must lose its
staging slot and committed state (Staging.reset_blocks), or the new request's
tokens would be taken for a record already written. Blocks found in the
prefix cache are not new and keep their records. Whether the runner also
zeroes them stays vLLM's answer (the worker's configuration is vLLM's own:
worker.py).
"""
import dataclasses

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig


class KvarnKVCacheConfig(KVCacheConfig):
    """vLLM's KVCacheConfig whose new blocks are always reported."""

    @property
    def needs_kv_cache_zeroing(self) -> bool:
        return True


def kvarn_kv_cache_config(kv_cache_config: KVCacheConfig) -> KVCacheConfig:
    """A KvarnKVCacheConfig with kv_cache_config's fields (vLLM's object is
    left as it is)."""
    if isinstance(kv_cache_config, KvarnKVCacheConfig):
        return kv_cache_config
    return KvarnKVCacheConfig(**{f.name: getattr(kv_cache_config, f.name)
                                 for f in dataclasses.fields(kv_cache_config) if f.init})


def whole_tile_hits(scheduler, vllm_config) -> None:
    """With a KV connector (offload.py's file tier) and a KVarN tile format:
    a hit that covers the whole prompt is cut back to the prompt's last
    whole tile before its end, so the last tile is recomputed rather than
    loaded. vLLM recomputes a whole hit's last token only
    (sched/scheduler.py:3172, num_computed_tokens = num_tokens - 1), whose
    query would then read its own tile from the record (Staging.plan, a
    committed block) where a cold run reads the tile's earlier tokens from
    the staging pool: the same greedy tokens, but the first logprob off by
    up to ~1 nat with kvarn_k4v2_g128 (tests/vllm/test_offload.py). vLLM's
    own prefix cache already stops a hit one block short of the prompt's end
    (kv_cache_manager's num_tokens - 1 cap). The connector's
    get_num_new_matched_tokens of this scheduler's connector object is
    wrapped (the count it returns is what update_state_after_alloc loads,
    offloading/scheduler.py:1146); per-token formats read every token from
    its record either way and are left alone."""
    conn = getattr(scheduler, "connector", None)
    dtype = vllm_config.cache_config.cache_dtype
    if conn is None or not str(dtype).startswith("kvarn_"):
        return
    from . import _lib
    fmt = _lib.parse_format(dtype)
    if not fmt.per_tile:
        return
    G = fmt.tile_tokens
    inner = conn.get_num_new_matched_tokens

    def get_num_new_matched_tokens(request, num_computed_tokens, *args, **kwargs):
        n, load_async = inner(request, num_computed_tokens, *args, **kwargs)
        if n and num_computed_tokens + n >= request.num_tokens:
            n = max(0, (request.num_tokens - 1) // G * G - num_computed_tokens)
            load_async = load_async and n > 0
        return n, load_async
    conn.get_num_new_matched_tokens = get_num_new_matched_tokens


class KvarnScheduler(Scheduler):
    """vLLM's Scheduler for a kvarn cache (module docstring)."""

    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
        super().__init__(vllm_config, kvarn_kv_cache_config(kv_cache_config), *args, **kwargs)
        whole_tile_hits(self, vllm_config)


class KvarnAsyncScheduler(AsyncScheduler):
    """vLLM's AsyncScheduler for a kvarn cache (module docstring)."""

    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
        super().__init__(vllm_config, kvarn_kv_cache_config(kv_cache_config), *args, **kwargs)
        whole_tile_hits(self, vllm_config)
