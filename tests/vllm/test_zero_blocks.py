"""Zeroing of newly allocated blocks where a kvarn layer's manager blocks
are split into kernel blocks (worker.zero_manager_blocks).

vLLM 0.32 zeroes the blocks it hands out where the cache mixes precisions
(KVCacheConfig.needs_kv_cache_zeroing): a kvarn layer's uint8 records beside
vLLM's fp32 sliding-window pages (Gemma-2/3/4 shapes). Its CPUModelRunner
zeroes kv[block_id] of each full-attention layer's cache tensor, whose dim 0
counts the backend's kernel blocks; a kvarn manager block of n tiles is n
kernel blocks, so vLLM zeroed a quarter of another block (n = 4 on the
Gemma-4 shape), one a prefix-cache hit then read: the greedy tokens after a
hit differed from the cold run's (test_families.py
test_family_prefix_caching_on_equals_off[gemma4] runs the engine). A fake
runner with the Gemma-4 layout (one storage: fp32 sliding pages, the kvarn
layer's view of 4 kernel blocks per manager block), no engine.
"""
from types import SimpleNamespace

import pytest
import torch

from kvarn_vllm import plugin, worker

N_BLOCKS = 6     # manager blocks
TILES = 4        # kernel blocks (tiles) per manager block: the Gemma-4 shape
PAGE = 512       # bytes of one manager block of one layer view (small here)


def _runner():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    # distinct non-zero bytes in every position: a wrong block zeroed, or a
    # block zeroed in part, shows
    store = (torch.arange(N_BLOCKS * PAGE, dtype=torch.int64) % 251 + 1).to(torch.uint8)
    kvarn = store.view(N_BLOCKS * TILES, 2, PAGE // (2 * TILES))      # [kernel blocks, Hk, ...]
    local = store.view(torch.float32).view(N_BLOCKS, 2, PAGE // 8)   # [blocks, Hk, ...] fp32
    full = FullAttentionSpec(block_size=TILES * 128, num_kv_heads=2, head_size=512,
                             dtype=torch.uint8)
    sliding = SlidingWindowSpec(block_size=128, num_kv_heads=2, head_size=256,
                                dtype=torch.float32, sliding_window=256)
    cfg = SimpleNamespace(num_blocks=N_BLOCKS, kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=sliding, layer_names=["local"]),
        SimpleNamespace(kv_cache_spec=full, layer_names=["global"])])
    ctx = {"local": SimpleNamespace(kv_cache=local), "global": SimpleNamespace(kv_cache=kvarn)}
    runner = SimpleNamespace(kv_cache_config=cfg, attn_groups=[],
                             compilation_config=SimpleNamespace(static_forward_context=ctx))
    return runner, store


def _zeroed_blocks(store) -> list:
    """Per manager block: 'all' (every byte 0), 'none', or 'part'."""
    out = []
    for b in store.view(N_BLOCKS, PAGE):
        z = int((b == 0).sum())
        out.append("all" if z == PAGE else "none" if z == 0 else "part")
    return out


def test_zero_manager_blocks_zeroes_whole_blocks_only():
    runner, store = _runner()
    before = store.clone().view(N_BLOCKS, PAGE)
    worker.zero_manager_blocks(runner, [1, 4])
    assert _zeroed_blocks(store) == ["none", "all", "none", "none", "all", "none"]
    after = store.view(N_BLOCKS, PAGE)
    for b in (0, 2, 3, 5):
        assert torch.equal(after[b], before[b])


def test_zero_manager_blocks_refuses_a_partial_split():
    runner, store = _runner()
    runner.kv_cache_config.num_blocks = N_BLOCKS * TILES - 1   # 23 does not divide 24
    before = store.clone()
    with pytest.raises(RuntimeError, match="not a multiple"):
        worker.zero_manager_blocks(runner, [1])
    assert torch.equal(store, before)


def test_vllm_cpu_runner_zeroes_kernel_blocks():
    """vLLM 0.32's own CPUModelRunner._zero_block_ids on the same layout
    zeroes kernel blocks 1 and 4 (a quarter of manager blocks 0 and 1) and
    leaves blocks 1 and 4 as they were: why the plug-in zeroes by manager
    block itself. Failing here means vLLM now zeroes whole manager blocks
    and the plug-in's override (worker._KvarnRunner._zero_block_ids) can go."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    plugin.register()
    own = CPUModelRunner._zero_block_ids
    runner, store = _runner()
    own(runner, [1, 4])
    assert _zeroed_blocks(store) == ["part", "part", "none", "none", "none", "none"]
