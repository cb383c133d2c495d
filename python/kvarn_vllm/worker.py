"""The kvarn worker classes, which vLLM builds through its public hook
(parallel_config.worker_cls, set by platform.py for a kvarn cache dtype):
vLLM's own worker (CPUWorker, or the GPU Worker) with

  determine_available_memory  the staging pool (or, for MLA records, the
                              tail pool) taken out of the KV budget, so the
                              capacity vLLM reports is what the cache holds;
  init_device                 vLLM's model runner given the kvarn runner
                              methods (_KvarnRunner): its block resets also
                              reset the staging state of blocks handed out
                              again, and on CPU zero them by manager block
                              where vLLM zeroes (zero_manager_blocks); the
                              draft counts of a speculative step are kept for
                              the attention metadata.

The runner is vLLM's own object; its class becomes a subclass of its class
with _KvarnRunner's methods first (kvarn_runner_class). vLLM 0.32 builds the
runner inside init_device and offers no hook for its class.
"""
import itertools

import numpy as np

from ._lib import is_kvarn_dtype


def _available_memory(worker, avail: int, budget_knob: str, device_type: str) -> int:
    """The KV budget avail (bytes, vLLM's) less the staging pool (layout.
    staging_pool) or the MLA tail pool; ValueError where the pool takes it
    all, naming the knobs that change it."""
    if not is_kvarn_dtype(worker.cache_config.cache_dtype):
        return avail
    if getattr(worker.vllm_config.model_config, "use_mla", False):
        from .mla_backend import reserve_tail_pool
        return reserve_tail_pool(worker.vllm_config, avail, budget_knob)
    from . import _lib
    from .state import _State
    from .layout import staging_pool
    ps = staging_pool(worker.vllm_config, avail, device_type)
    pool = ps["bytes"]
    if pool == 0:
        return avail     # no layer in the kvarn format, no pool
    _State.pool_size = ps
    seqs = worker.vllm_config.scheduler_config.max_num_seqs
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


class _KvarnRunner:
    """The kvarn methods of a model runner, before vLLM's runner class."""
    _kvarn_device_type = "cpu"
    kvarn_drafts = None   # (draft counts, cumulative token counts) of the last spec step

    def _zero_block_ids(self, block_ids):
        from .state import _State, kernel_block_ids
        _State.runner = self
        if _State.staging is not None:
            _State.staging.reset_blocks(kernel_block_ids(self, block_ids))
        if getattr(self.model_config, "use_mla", False):
            from .mla_backend import reset_blocks
            reset_blocks(block_ids)
        if is_kvarn_dtype(self.cache_config.cache_dtype):
            if not self.kv_cache_config.needs_kv_cache_zeroing:
                # reported only for kvarn's bookkeeping (scheduler.py): a
                # record is never read before its commit, nothing to zero
                return None
            if self._kvarn_device_type == "cpu":
                # vLLM 0.32's CPUModelRunner zeroes kv[block_id], a kernel
                # block of a kvarn layer whose manager blocks are split
                # (zero_manager_blocks)
                return zero_manager_blocks(self, block_ids)
        return super()._zero_block_ids(block_ids)

    # Speculative decoding: the runner works out each request's draft count
    # just before it builds the attention metadata; keep it (with the
    # cumulative token counts, to match it to its step) for the builder.
    def _calc_spec_decode_metadata(self, num_draft_tokens, cu_num_scheduled_tokens,
                                   *args, **kwargs):
        from .state import _State
        _State.runner = self
        self.kvarn_drafts = (np.array(num_draft_tokens, dtype=np.int32),
                             np.array(cu_num_scheduled_tokens, dtype=np.int64))
        return super()._calc_spec_decode_metadata(num_draft_tokens, cu_num_scheduled_tokens,
                                                  *args, **kwargs)


_runner_classes: dict = {}


def kvarn_runner_class(base: type, device_type: str) -> type:
    """The subclass of runner class base with _KvarnRunner's methods first."""
    cls = _runner_classes.get(base)
    if cls is None:
        cls = type("Kvarn" + base.__name__, (_KvarnRunner, base),
                   {"__module__": __name__, "_kvarn_device_type": device_type})
        _runner_classes[base] = cls
    return cls


def _adopt_runner(worker, runner_base: type, device_type: str) -> None:
    r = worker.model_runner
    if not isinstance(r, runner_base):
        raise ValueError(f"kvarn: vLLM built a {type(r).__name__} model runner; the kvarn "
                         f"cache runs with {runner_base.__name__} (vLLM's V1 runner: unset "
                         f"VLLM_USE_V2_MODEL_RUNNER)")
    r.__class__ = kvarn_runner_class(type(r), device_type)


def _worker_class(name: str, device_type: str) -> type:
    if device_type == "cpu":
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner as Runner
        from vllm.v1.worker.cpu_worker import CPUWorker as Worker
        knob = "VLLM_CPU_KVCACHE_SPACE"
    else:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as Runner
        from vllm.v1.worker.gpu_worker import Worker
        knob = "--gpu-memory-utilization"

    def init_device(self):
        Worker.init_device(self)
        _adopt_runner(self, Runner, device_type)

    def determine_available_memory(self) -> int:
        return _available_memory(self, Worker.determine_available_memory(self), knob,
                                 device_type)
    return type(name, (Worker,), {
        "__module__": __name__, "__doc__": f"vLLM's {Worker.__name__} for a kvarn cache",
        "init_device": init_device, "determine_available_memory": determine_available_memory})


_WORKERS = {"KvarnCPUWorker": "cpu", "KvarnGPUWorker": "cuda"}


def __getattr__(name: str):
    """KvarnCPUWorker and KvarnGPUWorker (module docstring), built on first
    use: vLLM's GPU worker does not import on its CPU build."""
    if name not in _WORKERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = _worker_class(name, _WORKERS[name])
    globals()[name] = cls
    return cls


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
