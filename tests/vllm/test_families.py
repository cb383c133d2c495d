"""The model families users serve, as small random-weight models
(make_models.py: per-layer shapes of Llama-3, Qwen2, Qwen3, Mistral,
Gemma-2, Gemma-3, Gemma-4 (head_dim 256 local, 512 global), Phi-3, gpt-oss,
Qwen3-Next (Gated DeltaNet linear attention, one full layer in 4)): vLLM with
kvarn_k4v2_g128 either serves them or refuses at
start-up, LLM(...) raising with the reason and what to do.

Served: against vLLM's own fp32 cache on the same prompt, the KL divergence
of the whole next-token distribution (every vocabulary entry: the models
have 2048) over the prompt positions whose queries read quantized tiles
must be what the codec does to those K/V. That figure, K_e, is computed
without vLLM (emulate.py: transformers in fp32, K/V through libkvarn's
kvarn_encode/kvarn_decode, the plug-in's read rule). The two are one codec
on the same K/V on two hosts, so vLLM's figure must be within the codec's
own effect of it, |K_v - K_e| <= K_e (the rule test_llama and test_serve
use for two paths of one format), and K_v >= K_e / 2 (the factor the other
way: a run that quantized fewer layers than it should, or none, fails).
Greedy tokens: where they first differ, the reference's probability margin
is at most sqrt(2 k) with k = 2 max K_e (Pinsker, test_serve's argument).
Prefix caching: the same prompt with its first 8 tiles found in vLLM's
prefix cache gives the same tokens as computed cold, in one engine.
"""
import os
import sys

import numpy as np
import pytest

from conftest import (bind_threads, check_greedy_near_tie, run_llm, staging_pool_bytes,
                      VLLM_CPU_BATCHED)

sys.path.insert(0, os.path.dirname(__file__))
import make_models  # noqa: E402

KV = "kvarn_k4v2_g128"
KVC = "kvarn_k4v2_g128c"     # mean-centred values (docs/kvarn-centred.md)
G = 128
VOCAB = make_models.VOCAB
PROMPT_LEN = 3 * G + 16      # 3 full tiles and 16 tokens of a 4th
READ_FROM = 2 * G            # first position whose query reads a record (sink 1 tile)
MAX_TOKENS = 16


def _ids(seed: int, n: int) -> list:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(3, VOCAB, n)]


PROMPT = _ids(1, PROMPT_LEN)
# prefix caching: LONG twice, and OTHER sharing its first SHARED tokens.
# vLLM shares whole blocks of its KV-cache manager; where layers of vLLM's
# own cache share the pool (Gemma-2), vLLM 0.32 makes those blocks 8 tiles
# (fp32 pages 8x kvarn's at head_dim 256), so 8 tiles are shared.
SHARED = 8 * G
LONG = _ids(3, SHARED + 16)
OTHER = LONG[:SHARED] + _ids(4, 16)


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("families"))
    return {f: make_models.make(f, out) for f in make_models.FAMILIES}


def _cfg(model, **kw):
    base = dict(model=model, prompt_ids=[PROMPT], max_tokens=MAX_TOKENS, logprobs=VOCAB,
                prompt_logprobs=VOCAB, max_logprobs=VOCAB, dense_logprobs=VOCAB)
    base.update(kw)
    return base


def _serve(model, env=None, prefix_caching=True):
    """(reference run, kvarn run): vLLM's fp32 cache, and kvarn with prefix
    caching on (unless prefix_caching is False): PROMPT (full logprobs),
    then LONG cold, then LONG and OTHER (their first SHARED tokens from the
    prefix cache)."""
    ref, _ = run_llm(_cfg(model, kv_cache_dtype="auto"))
    return (ref,) + _serve_kv_only(model, env or {}, prefix_caching=prefix_caching)[1:]


def _lp(seq, start):
    return np.array([row for row in seq[start:]], dtype=np.float64)


def _kl(p, q):
    return np.sum(np.exp(p) * (p - q), axis=-1)


def _check_served(model, ref, kv, quantize_sliding=False, fmt=KV):
    """kv (format fmt) against ref (vLLM's fp32 cache): the module
    docstring's rules; returns the emulated codec's KL per position."""
    import emulate
    exact = emulate.logprobs(model, PROMPT, quantize=False)
    # the plug-in's CPU default: int8 staging (settings.STAGING_DEFAULT)
    codec = emulate.logprobs(model, PROMPT, quantize=True, quantize_sliding=quantize_sliding,
                             staging="int8", fmt=fmt)
    # prompt_logprobs[j] is the distribution at position j - 1
    k_e = emulate.kl_rows(exact, codec)[READ_FROM:PROMPT_LEN - 1]
    P = _lp(ref["outputs"][0]["prompt_logprobs"], READ_FROM + 1)
    Q = _lp(kv["outputs"][0]["prompt_logprobs"], READ_FROM + 1)
    k_v = _kl(P, Q)
    k_ref = _kl(exact[READ_FROM:PROMPT_LEN - 1], P)
    print(f"{os.path.basename(model)}: KLD over {len(k_v)} positions: vLLM kvarn vs fp32 "
          f"{k_v.mean():.5f} (max {k_v.max():.5f}); codec on the same K/V (emulated) "
          f"{k_e.mean():.5f} (max {k_e.max():.5f}); vLLM fp32 vs transformers fp32 "
          f"{k_ref.mean():.2e}; KV tokens vLLM reports: fp32 cache {ref['kv_tokens']}, "
          f"kvarn {kv['kv_tokens']}")
    # the emulator runs the model vLLM runs: far closer than the codec's effect
    assert k_ref.mean() < k_e.mean() / 10
    assert k_e.mean() / 2 <= k_v.mean() <= 2 * k_e.mean()
    check_greedy_near_tie(ref, kv, k_e.max())
    return k_e


def _check_prefix_caching(kv):
    cold, = kv["rounds"][0]
    warm, other = kv["rounds"][1]
    assert cold["num_cached_tokens"] == 0
    assert warm["num_cached_tokens"] >= SHARED and other["num_cached_tokens"] >= SHARED, \
        (warm["num_cached_tokens"], other["num_cached_tokens"])
    assert warm["token_ids"] == cold["token_ids"]


SERVED = ["llama3", "qwen2", "qwen3", "gemma2_nocap", "gemma3", "gemma4"]


@pytest.fixture(scope="session")
def served(models):
    cache = {}

    def get(fam):
        if fam not in cache:
            cache[fam] = _serve(models[fam])
        return cache[fam]
    return get


@pytest.mark.parametrize("fam", SERVED)
def test_family_follows_fp32_cache(fam, models, served):
    ref, kv, _ = served(fam)
    _check_served(models[fam], ref, kv)


@pytest.mark.parametrize("fam", SERVED)
def test_family_prefix_caching_on_equals_off(fam, served):
    """gemma4 (the kvarn layer's manager block 4 tiles, vLLM zeroing the
    new blocks of a mixed-precision cache) failed from the first token
    while vLLM 0.32's CPU runner zeroed kernel blocks (test_zero_blocks.py)."""
    _check_prefix_caching(served(fam)[1])


@pytest.fixture(scope="session")
def mistral(models):
    m = models["mistral"]
    ref, kv, log = _serve(m)
    _, kvq, logq = _serve_kv_only(m, {"KVARN_SLIDING_WINDOW": "quantize"})
    return ref, kv, log, kvq, logq


def _serve_kv_only(model, env, fmt=KV, prefix_caching=True):
    cold = dict(prompt_ids=[LONG], logprobs=None, prompt_logprobs=None)
    again = dict(prompt_ids=[LONG, OTHER], logprobs=None, prompt_logprobs=None)
    rounds = [cold, again] if prefix_caching else []
    kv, log = run_llm(_cfg(model, kv_cache_dtype=fmt, prefix_caching=prefix_caching,
                           rounds=rounds, env=env))
    return None, kv, log


def test_sliding_window_layers_keep_vllm_cache_by_default(mistral):
    """Mistral (a sliding window on every layer): by default no layer is
    quantized, with a warning saying so; the run is then vLLM's own fp32
    cache, same kernels, same pages: the same tokens and log-probs."""
    ref, kv, log, _, _ = mistral
    assert "nothing is quantized" in log and "KVARN_SLIDING_WINDOW=quantize" in log
    r, k = ref["outputs"][0], kv["outputs"][0]
    assert r["token_ids"] == k["token_ids"]
    d = np.abs(_lp(r["prompt_logprobs"], 1) - _lp(k["prompt_logprobs"], 1)).max()
    assert d == 0.0, d
    _check_prefix_caching(kv)


def test_sliding_window_quantize(models, mistral):
    """KVARN_SLIDING_WINDOW=quantize: every layer in the kvarn format, the
    kernels applying the window; against the emulation with the same
    window (the prompt is longer than the window, 256 tokens)."""
    ref, _, _, kvq, _ = mistral
    _check_served(models["mistral"], ref, kvq, quantize_sliding=True)
    _check_prefix_caching(kvq)


@pytest.fixture(scope="session")
def gpt_oss(models):
    """gpt-oss's shape (learned sinks, sliding and full layers alternating,
    unquantized experts): vLLM's fp32 cache; kvarn by default (the sliding
    layers in vLLM's cache; the prompt only: prefix caching of that hybrid
    is Gemma-2's test); every layer in kvarn (KVARN_SLIDING_WINDOW=
    quantize, with the prefix-caching rounds)."""
    m = models["gpt_oss"]
    ref, _ = run_llm(_cfg(m, kv_cache_dtype="auto"))
    kv, log = run_llm(_cfg(m, kv_cache_dtype=KV))
    _, kvq, logq = _serve_kv_only(m, {"KVARN_SLIDING_WINDOW": "quantize"})
    return ref, kv, log, kvq, logq


def test_gpt_oss_sinks_follow_fp32_cache(models, gpt_oss):
    """The learned sinks reach the kernels: the full layers in kvarn follow
    vLLM's fp32 cache within the emulated codec's bounds (the emulation
    puts the sink in each softmax as transformers does; make_models sets
    the sinks where they take a large share of attention, so a kernel
    without them fails this), greedy sane."""
    ref, kv, log, _, _ = gpt_oss
    assert "2 of 4 attention layers" in log, log[-3000:]
    # the kvarn pages (114 bytes a token) do not divide fp32's (1024):
    # manager blocks of 9 tiles, one fp32 page (layout.align_pages), said
    # at start-up with what a request takes in both caches
    assert "manager blocks of 9 tiles (1152 tokens)" in log, log[-3000:]
    factor = float(log.split("x its requests per KV byte")[0].rsplit(" ", 1)[1])
    assert factor >= 1.0, factor
    _check_served(models["gpt_oss"], ref, kv)


def test_gpt_oss_sliding_layers_quantized(models, gpt_oss):
    """KVARN_SLIDING_WINDOW=quantize: the sliding layers (window 128, the
    prompt 400 tokens) in kvarn too, the kernels applying window and sink;
    against the emulation with both; prefix caching on = off; the blocks
    vLLM reports are the per-layer arithmetic of every layer in kvarn (one
    KV-cache group: backend.customize_spec)."""
    ref, _, _, kvq, _ = gpt_oss
    _check_served(models["gpt_oss"], ref, kvq, quantize_sliding=True)
    _check_prefix_caching(kvq)
    _, hk, _ = _shape("gpt_oss")
    assert kvq["kv_blocks"] == _kv_blocks("gpt_oss", hk)


@pytest.mark.parametrize("fam,needles", [
    # a per-token format serves head_dim 96 (test_ladder's
    # test_per_token_serves_head_dim_96): the message names it
    ("phi3", ["head_dim 96", "64, 128, 256 or 512", "--kv-cache-dtype kvarn_int8",
              "--kv-cache-dtype auto"]),
    ("gemma2", ["soft-caps its attention logits", "--kv-cache-dtype auto"]),
    # run_llm's default --dtype float32: vLLM's CPU Gated DeltaNet is bf16 only
    ("qwen3_next", ["linear-attention (Gated DeltaNet)", "CPU GDN attention requires BF16.",
                    "--dtype bfloat16"]),
])
def test_family_refused_at_start(fam, needles, models):
    """LLM(...) itself raises with the reason and what to do (not only
    vLLM's "Engine core initialization failed" with the cause in a worker's
    log)."""
    res, out = run_llm(dict(model=models[fam], kv_cache_dtype=KV, prompt_ids=[[5, 6, 7]],
                            max_tokens=1), expect_ok=False)
    assert res is None
    line = next((x for x in out.splitlines() if x.startswith("STARTUP_ERROR ")), "")
    for n in needles:
        assert n in line, out[-3000:]


def _engine_config(model, monkeypatch, policy=None, prefix_caching=False):
    from vllm.engine.arg_utils import EngineArgs
    if policy is None:
        monkeypatch.delenv("KVARN_SLIDING_WINDOW", raising=False)
    else:
        monkeypatch.setenv("KVARN_SLIDING_WINDOW", policy)
    return EngineArgs(model=model, kv_cache_dtype=KV, block_size=G, max_model_len=2048,
                      enable_prefix_caching=prefix_caching).create_engine_config()


@pytest.mark.parametrize("fam,policy,skip", [
    ("mistral", None, ["sliding_window"]),
    ("mistral", "vllm", ["sliding_window"]),
    ("mistral", "quantize", []),
    ("gemma2_nocap", None, ["sliding_window"]),
    ("gemma3", None, ["sliding_window"]),
    ("gemma4", None, ["sliding_window"]),
    ("llama3", None, []),
])
def test_sliding_window_setting_sets_skip_layers(fam, policy, skip, models, monkeypatch):
    """KVARN_SLIDING_WINDOW in the config vLLM builds: sliding-window models
    get vLLM 0.32's kv_cache_dtype_skip_layers entry 'sliding_window' unless
    the setting is 'quantize'; models without a window get none."""
    cfg = _engine_config(models[fam], monkeypatch, policy)
    assert cfg.cache_config.kv_cache_dtype_skip_layers == skip


def test_mixed_head_dims_in_kvarn_are_refused(models, monkeypatch):
    """Gemma-4 with KVARN_SLIDING_WINDOW=quantize: its kvarn layers would
    mix head_dim 256 (sliding) and 512 (global), which the staging pool's
    one page shape cannot hold: refused when vLLM builds its config, with
    the head_dims and the setting that serves it (the default)."""
    with pytest.raises(ValueError, match=r"head_dims 256, 512.*KVARN_SLIDING_WINDOW=vllm"):
        _engine_config(models["gemma4"], monkeypatch, "quantize")


def test_mixed_head_dims_keep_prefix_caching(models, monkeypatch):
    """Gemma-4 (head_dim 256 local, 512 global, the global layer in kvarn)
    and Gemma-3 (256 throughout) keep vLLM's prefix caching: their tokens
    after a hit are those of the cold run
    (test_family_prefix_caching_on_equals_off)."""
    for fam in ("gemma4", "gemma3"):
        assert _engine_config(models[fam], monkeypatch,
                              prefix_caching=True).cache_config.enable_prefix_caching


def test_kv_shared_layers_are_refused(models, monkeypatch, tmp_path):
    """A Gemma-4 config with num_kv_shared_layers > 0 has its last layers
    read the KV cache of earlier layers, which the kvarn backend does not do:
    refused when vLLM builds its config (not only in the worker, whose
    error vLLM reports as "Engine core initialization failed"), naming the
    kvarn layers among them (here the last two: a sliding-window one, kept
    in vLLM's cache, and the global one). The Gemma-4 shape with that one
    config entry changed (vLLM reads only the config here)."""
    import json
    src = models["gemma4"]
    for f in os.listdir(src):
        if f != "config.json":
            os.symlink(os.path.join(src, f), tmp_path / f)
    with open(os.path.join(src, "config.json")) as f:
        c = json.load(f)
    c["num_kv_shared_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=r"num_kv_shared_layers.*1 of them.*layers 5\b"):
        _engine_config(str(tmp_path), monkeypatch)


def test_bad_sliding_window_setting_is_a_clear_error(models, monkeypatch):
    with pytest.raises(ValueError, match="KVARN_SLIDING_WINDOW must be 'vllm'.*'quantize'"):
        _engine_config(models["mistral"], monkeypatch, "fp16")


def _shape(fam: str) -> tuple:
    """(layers, KV heads, head_dim) of FAMILIES[fam]."""
    kw = make_models.FAMILIES[fam][1]
    d = kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"]
    return kw["num_hidden_layers"], kw["num_key_value_heads"], d


def _kv_blocks(fam: str, kv_heads: int, world: int = 1, fmt: str = KV) -> int:
    """The blocks vLLM must report for FAMILIES[fam] with every layer in
    kvarn_k4v2_g128 and kv_heads KV heads on this rank, at run_llm's budget
    (VLLM_CPU_KVCACHE_SPACE 1 GiB) and max_num_seqs 8: the budget less the
    int8 staging pool (conftest.staging_pool_bytes: 8 sequences x sink +
    tail tiles of every layer and KV head, the scratch of vLLM's
    max_num_batched_tokens), in record pages (the record size from the
    library)."""
    from kvarn_vllm import _lib
    layers, _, d = _shape(fam)
    record = _lib.record_bytes(_lib.parse_format(fmt, d), d)
    pool = staging_pool_bytes(layers, kv_heads, d, 8, batched=VLLM_CPU_BATCHED * world)
    return (2**30 - pool) // (layers * kv_heads * record)


@pytest.mark.parametrize("fam", ["llama3", "qwen2", "qwen3"])
def test_family_capacity_is_the_arithmetic(fam, served):
    """KV tokens vLLM reports, kvarn and its fp32 cache: the per-layer
    arithmetic of each (every layer of these models is in kvarn)."""
    ref, kv, _ = served(fam)
    layers, hk, d = _shape(fam)
    assert ref["kv_tokens"] == 2**30 // (layers * hk * 2 * d * 4 * G) * G
    assert kv["kv_blocks"] == _kv_blocks(fam, hk)


def _layer_shapes(model: str) -> tuple:
    """([(KV heads, head_dim)] of the sliding-window layers, the same of the
    others) from the model's config.json (Gemma-4: per_layer_config gives
    the global layers' head_dim)."""
    import json
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    per = c.get("per_layer_config") or {}
    shape = [(int(per.get(str(i), {}).get("num_key_value_heads", c["num_key_value_heads"])),
              int(per.get(str(i), {}).get("head_dim", c["head_dim"])))
             for i in range(c["num_hidden_layers"])]
    sliding = [s for s, t in zip(shape, c["layer_types"]) if t == "sliding_attention"]
    return sliding, [s for s, t in zip(shape, c["layer_types"]) if t != "sliding_attention"]


@pytest.mark.parametrize("fam", ["gemma3", "gemma4"])
def test_hybrid_capacity_is_the_arithmetic(fam, models, served):
    """Sliding-window layers in vLLM's fp32 cache, the others in
    kvarn_k4v2_g128 (Gemma-4's at head_dim 512): vLLM 0.32 gives every
    layer one page size (kv_cache_utils.unify_kv_cache_spec_page_size), a
    layer of smaller pages getting blocks of several tiles, and with a 5:1
    pattern one layer per KV-cache group, so the budget is cut in blocks of
    the largest page. Pages per tile: fp32 Hk x 2 x D x 4 x G bytes, kvarn
    Hk x record bytes, whose per-token share is a power of two at D >= 256
    (../shared/spec/KVARN.md): so every page divides the largest and none
    is padded. Blocks: the budget (less the staging pool, for kvarn) over
    the largest page."""
    from kvarn_vllm import _lib
    ref, kv, _ = served(fam)
    sliding, rest = _layer_shapes(models[fam])

    def fp32(hk, d):
        return hk * 2 * d * 4 * G

    def rec(hk, d):
        return hk * _lib.record_bytes(_lib.parse_format(KV, d), d)
    assert ref["kv_blocks"] == 2**30 // max(fp32(*s) for s in sliding + rest)
    pages = [fp32(*s) for s in sliding] + [rec(*s) for s in rest]
    assert all(max(pages) % p == 0 for p in pages), pages
    assert len(set(rest)) == 1
    hk, d = rest[0]
    pool = staging_pool_bytes(len(rest), hk, d, 8)
    assert kv["kv_blocks"] == (2**30 - pool) // max(pages)
    print(f"{fam}: blocks fp32 {ref['kv_blocks']}, kvarn {kv['kv_blocks']} "
          f"({kv['kv_blocks'] / ref['kv_blocks']:.2f}x); pages per tile {pages}")


def test_tensor_parallel_2_follows_fp32_cache(models, served):
    """Llama-3's shape (2 KV heads) at TP=2: each rank stores its own KV
    head's records in its own budget and pool (blocks: the per-rank
    arithmetic, one KV head), and the output is held to TP=1's rule: the
    codec works per tile and KV head, so sharding the heads must not change
    what it does (KLD to vLLM's fp32 cache within the emulated codec's
    bound)."""
    ref, _, _ = served("llama3")
    tp, _ = run_llm(_cfg(models["llama3"], kv_cache_dtype=KV, tensor_parallel_size=2,
                         env=bind_threads(2)))
    assert tp["kv_blocks"] == _kv_blocks("llama3", 1, world=2)
    _check_served(models["llama3"], ref, tp)


def test_centred_values_on_a_model_with_value_biases(models, served):
    """Qwen2 adds a bias to q, k and v: the plug-in warns at start-up that
    kvarn_k4v2_g128 quantizes the value bias with the rest and names the
    mean-centred kvarn_k4v2_g128c (no such warning for Llama-3, which has
    none, nor for the centred format itself). Served, the centred format
    follows vLLM's fp32 cache within its own emulated codec's bound (the
    module docstring's rules, emulated with the same centred format), its
    prefix caching equals computing cold, its blocks are the arithmetic of
    its records (2D bytes of channel means more per record), and on this
    model it is the better format: its emulated KL below the plain
    format's."""
    ref, kv, log = served("qwen2")
    warning = "adds a bias to its values"
    assert warning in log and f"--kv-cache-dtype {KVC}" in log, log[-3000:]
    assert warning not in served("llama3")[2]
    _, kvc, logc = _serve_kv_only(models["qwen2"], {}, fmt=KVC)
    assert warning not in logc
    layers, hk, _ = _shape("qwen2")
    assert kvc["kv_blocks"] == _kv_blocks("qwen2", hk, fmt=KVC) < kv["kv_blocks"]
    k_c = _check_served(models["qwen2"], ref, kvc, fmt=KVC)
    _check_prefix_caching(kvc)
    import emulate
    exact = emulate.logprobs(models["qwen2"], PROMPT, quantize=False)
    plain = emulate.logprobs(models["qwen2"], PROMPT, quantize=True, staging="int8")
    k_p = emulate.kl_rows(exact, plain)[READ_FROM:PROMPT_LEN - 1]
    print(f"qwen2 emulated KL: {KV} {k_p.mean():.5f}, {KVC} {k_c.mean():.5f}")
    assert k_c.mean() < k_p.mean()


def _gdn_state_bytes(kw: dict) -> int:
    """One Gated DeltaNet layer's recurrent state in vLLM 0.32 (its page in
    the Mamba-type KV-cache group): the causal conv's last kernel - 1 inputs
    of the q, k, v channels at the model's dtype (bf16) and the delta-rule
    state [value heads, key dim, value dim] at vLLM's SSM state dtype, which
    depends on the CPU: fp32 where torch reports AVX512-BF16 (Zen 4, Intel
    Xeons of the 4th generation: vLLM's CPU platform resets it to float32
    for its accelerated GDN backend, platforms/cpu.py
    check_and_update_config), else mamba_ssm_cache_dtype "auto", the
    model's dtype (bf16; AVX2-only hosts, where the manager block is then
    256 tokens, not 384)."""
    import torch
    conv_dim = (2 * kw["linear_num_key_heads"] * kw["linear_key_head_dim"]
                + kw["linear_num_value_heads"] * kw["linear_value_head_dim"])
    conv = (kw["linear_conv_kernel_dim"] - 1) * conv_dim * 2
    ssm_elt = 4 if torch.cpu._is_avx512_bf16_supported() else 2
    ssm = (kw["linear_num_value_heads"] * kw["linear_key_head_dim"]
           * kw["linear_value_head_dim"] * ssm_elt)
    return conv + ssm


def test_qwen3_next_hybrid_linear_attention(models):
    """Qwen3-Next's shape (3 Gated DeltaNet layers : 1 full-attention layer),
    --dtype bfloat16 (vLLM's CPU build runs the linear-attention layers in
    bf16 only; float32 is refused, test_family_refused_at_start). The full
    layer in kvarn, the recurrent state in vLLM's own cache. vLLM 0.32 raises
    the attention layers' manager block until its page covers one linear
    layer's state (block tokens: a multiple of the kernel block, 128) and
    pads the state page to it; kvarn splits that block into one-tile kernel
    blocks. Blocks: the budget (less the staging pool of the one kvarn layer)
    over that page, for vLLM's bf16 cache (2 x D x 2 bytes a token and KV
    head) and for kvarn (record bytes a tile and KV head). Output: against
    vLLM's own bf16 cache, the module docstring's KL and greedy rules, the
    codec's effect K_e emulated in fp32 on the full layer only (the emulation
    swaps the attention layers' KV path; the DeltaNet layers run as
    transformers runs them); vLLM's bf16 run must still be far closer to
    transformers' fp32 than the codec's effect (1/10 of K_e, as for fp32).
    Prefix caching: a hit of one manager block gives the cold tokens."""
    import emulate
    from kvarn_vllm import _lib
    m = models["qwen3_next"]
    kw = make_models.FAMILIES["qwen3_next"][1]
    hk, d = kw["num_key_value_heads"], kw["head_dim"]
    state = _gdn_state_bytes(kw)
    ref, _ = run_llm(_cfg(m, kv_cache_dtype="auto", dtype="bfloat16"))
    rec = hk * _lib.record_bytes(_lib.parse_format(KV, d), d)  # a tile
    tiles = -(-state // rec)                                   # a kvarn block
    # prefix caching: vLLM 0.32 shares this hybrid's blocks in its Mamba
    # 'align' mode, whole manager blocks with the DeltaNet state at their
    # end: HOLD shares its first block with HIT
    blk_tok = tiles * G
    hold = _ids(3, blk_tok + 16)
    hit = hold[:blk_tok] + _ids(4, 16)
    rounds = [dict(prompt_ids=[hit], logprobs=None, prompt_logprobs=None),
              dict(prompt_ids=[hit, hold], logprobs=None, prompt_logprobs=None)]
    kv, log = run_llm(_cfg(m, kv_cache_dtype=KV, dtype="bfloat16", prefix_caching=True,
                           rounds=rounds))
    tok = hk * 2 * d * 2                                      # bf16 K and V, a token
    blk = G * -(-state // (G * tok))
    assert ref["kv_tokens"] == ref["kv_blocks"] * blk
    assert ref["kv_blocks"] == 2**30 // (blk * tok)
    assert kv["kv_tokens"] == kv["kv_blocks"] * tiles * G
    pool = staging_pool_bytes(1, hk, d, 8)
    assert kv["kv_blocks"] == (2**30 - pool) // (tiles * rec)
    cold, = kv["rounds"][0]
    warm, other = kv["rounds"][1]
    assert cold["num_cached_tokens"] == 0
    assert warm["num_cached_tokens"] == other["num_cached_tokens"] == blk_tok
    assert warm["token_ids"] == cold["token_ids"]
    print(f"qwen3_next: block {blk} tokens bf16, {tiles * G} kvarn; KV tokens bf16 "
          f"{ref['kv_tokens']}, kvarn {kv['kv_tokens']}")
    exact = emulate.logprobs(m, PROMPT, quantize=False)
    codec = emulate.logprobs(m, PROMPT, quantize=True, staging="int8")
    k_e = emulate.kl_rows(exact, codec)[READ_FROM:PROMPT_LEN - 1]
    k_v = _kl(_lp(ref["outputs"][0]["prompt_logprobs"], READ_FROM + 1),
              _lp(kv["outputs"][0]["prompt_logprobs"], READ_FROM + 1))
    k_ref = _kl(exact[READ_FROM:PROMPT_LEN - 1],
                _lp(ref["outputs"][0]["prompt_logprobs"], READ_FROM + 1))
    print(f"qwen3_next: KLD over {len(k_v)} positions: vLLM kvarn vs bf16 {k_v.mean():.5f} "
          f"(max {k_v.max():.5f}); codec emulated in fp32 {k_e.mean():.5f}; vLLM bf16 vs "
          f"transformers fp32 {k_ref.mean():.2e}")
    assert k_ref.mean() < k_e.mean() / 10
    assert k_e.mean() / 2 <= k_v.mean() <= 2 * k_e.mean()
    check_greedy_near_tie(ref, kv, k_e.max())
