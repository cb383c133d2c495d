"""The plug-in's CUDA path (python/kvarn_vllm/ops.py CudaOps) on a machine
without a GPU: every call it makes to libkvarn_cuda.so goes to
tests/vllm/cuda_emulator.py, which checks each argument against
include/kvarn/cuda.h's contract, uses the real host-side functions of
build/libkvarn_cuda.so (page-layout check, attention plan) where that was
built, and runs the CPU kernels on the same pages. What this cannot show is
the CUDA kernels themselves (tests/cuda, on a GPU).

Same engine, same prompts, model in bfloat16 (the CUDA store takes
fp16/bf16 activations): the emulated CUDA path must give exactly the CPU
path's tokens and logprobs, since both end in the same kernels on the same
bytes; any difference is a marshalling error (a view, plan, slot, table or
query range handed over wrongly)."""
import os

import pytest

from conftest import run_llm
from test_serve import PROMPTS, SHARED

KV = "kvarn_k4v2_g128"
EMULATOR = os.path.join(os.path.dirname(__file__), "cuda_emulator.py")
# one partitioning of the work in both runs; fp16 staging, the CUDA
# kernels' (the CPU path's default is int8); every tile committed from its
# staged page, as the CUDA kernels commit (the CPU path's default commits a
# prefill chunk's whole tiles from the exact K/V: KVARN_PREFILL_COMMIT)
ENV = {"KVARN_ATTN_THREADS": "2", "KVARN_STAGING": "fp16", "KVARN_PREFILL_COMMIT": "staged"}


@pytest.fixture(scope="module")
def pair(hf_model):
    base = dict(prompts=PROMPTS + SHARED, max_tokens=16, logprobs=2, dtype="bfloat16",
                kv_cache_dtype=KV, prefix_caching=True, warm_prompts=[SHARED[0]])
    cpu, cpu_log = run_llm(dict(base, env=ENV))
    emu, emu_log = run_llm(dict(base, env=dict(ENV, KVARN_TEST_CUDA_EMULATOR=EMULATOR)))
    return cpu, cpu_log, emu, emu_log


def test_emulated_cuda_path_was_taken(pair):
    _, cpu_log, _, emu_log = pair
    assert "kvarn: cpu kernels" in cpu_log
    assert "kvarn: cuda kernels" in emu_log


def test_cuda_path_equals_cpu_path(pair):
    cpu, _, emu, _ = pair
    assert cpu["kv_tokens"] == emu["kv_tokens"]
    for a, b in zip(cpu["outputs"], emu["outputs"]):
        assert a["token_ids"] == b["token_ids"]
        assert a["logprobs"] == b["logprobs"]  # same kernels, same bytes: exact
        assert a["num_cached_tokens"] == b["num_cached_tokens"]


def test_cuda_path_refuses_fp32_activations(hf_model):
    res, log = run_llm(dict(prompts=PROMPTS[:1], max_tokens=2, kv_cache_dtype=KV,
                            env=dict(ENV, KVARN_TEST_CUDA_EMULATOR=EMULATOR)),
                       expect_ok=False)
    assert res is None
    assert "CUDA store takes float16 or bfloat16" in log
