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


class KvarnScheduler(Scheduler):
    """vLLM's Scheduler for a kvarn cache (module docstring)."""

    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
        super().__init__(vllm_config, kvarn_kv_cache_config(kv_cache_config), *args, **kwargs)


class KvarnAsyncScheduler(AsyncScheduler):
    """vLLM's AsyncScheduler for a kvarn cache (module docstring)."""

    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
        super().__init__(vllm_config, kvarn_kv_cache_config(kv_cache_config), *args, **kwargs)
