"""MLA (DeepSeek-V3/R1, Kimi-K2 attention) through vLLM 0.32's CPU build, on
a random-weight model of DeepSeek-V3's attention shape (make_models.py
"deepseek_v3": per token one 512-wide latent and one 64-wide RoPE key).

vLLM's own cache: the CPU platform picks its MLA backend (CPU_MLA; AMX_MLA
where the CPU has AMX tiles), forces blocks of 16 tokens and turns chunked
prefill and prefix caching off; the prompt runs as MHA on the fresh
latents, each decoded token as absorbed MQA over the cache. The reference
runs ask for CPU_MLA (attention_backend), vLLM's reference MLA backend,
which it then picks on every CPU kind: on a CPU with AMX tiles vLLM 0.32
would otherwise pick AMX_MLA, which refuses fp32 weights ("expect weight
to be bfloat16, float16, int8, fp8_e4m3 or uint8") and blocks of 16 ("No
common block size for 16 (AMX_MLA: [MultipleOf(32)])"). The fp32 reference
and the kvarn_mla_k4_g128 run also answer True to vLLM's AMX question
(run_llm fake_amx: torch.cpu._is_amx_tile_supported), so a host without
AMX takes an AMX host's start-up decisions for them (backend, block size)
and the tests hold for both kinds on either; the bf16 reference cannot
(its MoE layer would then run AMX kernels), nor the slot and batch runs,
which keep the non-AMX decisions. Checked here:
the KV tokens vLLM reports are the arithmetic (its KV budget over layers x
(kv_lora_rank + qk_rope_head_dim) x the element's bytes, in blocks of 16),
and its next-token distributions, at prompt and decoded positions, are
transformers' on the same tokens (emulate_mla.py, fp32, with the RoPE
as vLLM's CPU build applies it, below): the fp32 cache within a tenth of
what the bf16 run's rounding does to them (that run's KL to transformers
on its own tokens, measured beside it: a bound from the format's own
effect, as test_families derives its bounds).

vLLM 0.32's CPU rotary_embedding kernel takes a strided view's stride(-2)
as its token stride, and DeepSeek's MLA layer hands it two strided views
(q_pe, k_pe): most prompt queries and keys are not rotated at all
(emulate_mla.py's docstring has the rule). test_vllm_cpu_rope_strided_views
pins that rule against vLLM's own forward_native, so that a vLLM that fixes
it fails here (and emulate_mla's vllm_rope default must follow).

kvarn_mla_k4_g128 (mla_backend.py: one MLA record per block of G = 128
tokens, the latent as a 4-bit KVarN K tile and the RoPE key int8 per
token, include/kvarn/mla.h; the tile not yet full in an fp32 tail;
decode: kvarn_mla_attn, absorbed) against vLLM's fp32 MLA cache: the KV
tokens vLLM reports are its budget less the tail pool over the record
bytes of every layer; at the decoded positions the KL divergence to the
exact model must be the codec's, K_e (emulate_mla.py: transformers with
each whole tile's latent and RoPE key through libkvarn's kvarn_mla_encode +
kvarn_mla_decode and the backend's read rule), within test_families'
rule |K_v - K_e| <= K_e, and position by position vLLM's distributions must
be the emulated codec's (KL < K_e / 10: same records, same reads); the
prompt's positions (MHA on fresh latents) see no codec; greedy tokens equal
the fp32 cache's up to near-ties (Pinsker, as test_families). Also: three
sequences one after another through one tail slot, and three decoded in
one batch (with vLLM's RoPE made the trained model's, as the emulation
then runs it), each position by position the emulated codec's.

Refused at start-up with the reason: a K/V-tile kvarn format on an MLA
model, an MLA format on a model without MLA, an unknown MLA name,
speculative decoding, a latent the record cannot hold.
"""
import os
import sys

import numpy as np
import pytest

from conftest import check_greedy_near_tie, run_llm

sys.path.insert(0, os.path.dirname(__file__))
import make_models  # noqa: E402

VOCAB = make_models.VOCAB
G = 128
PROMPT_LEN = 2 * G + 100     # decoding crosses the tile boundary at 3G
MAX_TOKENS = 40
MLA_BLOCK = 16               # vLLM's CPU platform forces it for MLA (platforms/cpu.py)
MLA_FMT = "kvarn_mla_k4_g128"
# vLLM's own MLA cache as the reference: its reference backend on every CPU
# kind (module docstring; AMX_MLA refuses fp32 weights and blocks of 16)
REF_MLA = dict(attention_backend="CPU_MLA")


def _ids(seed: int, n: int) -> list:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(3, VOCAB, n)]


PROMPT = _ids(11, PROMPT_LEN)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_models.make("deepseek_v3", str(tmp_path_factory.mktemp("mla")))


@pytest.fixture(scope="module")
def ref_fp32(model):
    """vLLM's own fp32 MLA cache on PROMPT, CPU_MLA asked for, with the
    start-up decisions of a host with AMX tiles (module docstring):
    (result, log)."""
    return run_llm(_cfg(model, kv_cache_dtype="auto", dtype="float32", **REF_MLA,
                        fake_amx=True))


def _cfg(model, **kw):
    base = dict(model=model, prompt_ids=[PROMPT], max_tokens=MAX_TOKENS, logprobs=VOCAB,
                prompt_logprobs=VOCAB, max_logprobs=VOCAB, dense_logprobs=VOCAB,
                ignore_eos=True, block_size=MLA_BLOCK)
    base.update(kw)
    return base


def _dims(model):
    import json
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    return c["num_hidden_layers"], c["kv_lora_rank"], c["qk_rope_head_dim"]


def _lp_rows(res):
    """The run's log-probabilities as rows of the emulator's matrix: row j
    is the distribution of token j + 1 of prompt + generated (rows from 0 to
    the last prompt position from prompt_logprobs, whose entry j is the
    distribution at position j - 1; the decoded ones from logprobs)."""
    o = res["outputs"][0]
    rows = [r for r in o["prompt_logprobs"][1:]] + [r for r in o["logprobs"]]
    return np.array(rows, dtype=np.float64)


def _kl_to_transformers(model, res):
    """KL(transformers fp32 || vLLM) per position of the run's own token
    sequence (prompt positions, then decoded ones)."""
    import emulate_mla
    o = res["outputs"][0]
    seq = PROMPT + o["token_ids"]
    exact = emulate_mla.logprobs(model, seq[:-1], PROMPT_LEN)
    return emulate_mla.kl_rows(exact, _lp_rows(res))


def test_vllm_own_mla_cache(model, ref_fp32):
    layers, latent, rope = _dims(model)
    runs = {}
    for dtype, elt in (("float32", 4), ("bfloat16", 2)):
        res, log = ref_fp32 if dtype == "float32" else \
            run_llm(_cfg(model, kv_cache_dtype="auto", dtype=dtype, **REF_MLA))
        assert "Using CPU_MLA backend" in log
        # 1 GiB of KV (run_llm's kv_space_gib) in blocks of 16 tokens, each
        # token one latent + RoPE key per layer
        block = layers * MLA_BLOCK * (latent + rope) * elt
        assert res["kv_blocks"] == (1 << 30) // block, (dtype, res["kv_blocks"])
        assert res["kv_tokens"] == res["kv_blocks"] * MLA_BLOCK
        kl = _kl_to_transformers(model, res)
        pre, dec = kl[: PROMPT_LEN - 1], kl[PROMPT_LEN - 1:]
        print(f"{dtype}: KV tokens {res['kv_tokens']}; KL to transformers fp32: prompt "
              f"{pre.mean():.2e} (max {pre.max():.2e}), decoded {dec.mean():.2e} "
              f"(max {dec.max():.2e}); tokens {res['outputs'][0]['token_ids'][:12]}...")
        runs[dtype] = (pre, dec, res)
    # fp32: the same model as transformers', at prompt (MHA) and decoded
    # (absorbed MQA over the cache) positions, far closer than bf16 is
    for part in (0, 1):
        assert runs["float32"][part].mean() < runs["bfloat16"][part].mean() / 10
    # the bf16 run is not broken either: its KL to transformers is
    # rounding-sized (bf16: 8 bits of mantissa; a wrong cache would show
    # KL of order one, as distributions of random tokens do)
    assert runs["bfloat16"][1].mean() < 0.05


_ROPE_PROBE = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import emulate_mla
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
S, H, NOPE, ROPE, QL, KL = 40, 8, 128, 64, 1536, 512   # DeepSeek-V3's widths
W = QL + KL + ROPE
bad = []
with set_current_vllm_config(VllmConfig()):
    r = get_rope(ROPE, max_position=4096,
                 rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                 is_neox_style=False)
    for P, first in ((S, 0), (1, 300)):      # a prompt's step; a decode step
        pos = torch.arange(first, first + P)
        q = torch.randn(P, H, NOPE + ROPE)
        lora = torch.randn(P, W)
        q0, lora0 = q.clone(), lora.clone()
        # as vllm/model_executor/layers/mla.py calls it
        r.forward_cpu(pos, q[..., NOPE:], lora.split([QL + KL, ROPE], dim=-1)[1].unsqueeze(1))
        if first == 0:
            qpos, kpos = emulate_mla._rope_positions(P, H, P, W // ROPE)
        else:   # decode: emulate_mla numbers positions from 0, the step is one token
            qpos = torch.tensor([[first]] + [[-1]] * (H - 1))
            kpos = torch.tensor([first])
        def rot(x, p):   # forward_native on one contiguous piece, or none
            if p < 0:
                return x
            out, _ = r.forward_native(torch.tensor([p]), x.reshape(1, ROPE).clone(),
                                      torch.zeros(1, 1, ROPE))
            return out.reshape(ROPE)
        for t in range(P):
            for h in range(H):
                want = rot(q0[t, h, NOPE:], int(qpos[h, t]))
                if not torch.allclose(q[t, h, NOPE:], want, atol=1e-5):
                    bad.append(("q", P, t, h))
            if not torch.allclose(lora[t, QL + KL:], rot(lora0[t, QL + KL:], int(kpos[t])),
                                  atol=1e-5):
                bad.append(("k", P, t))
print("RESULT " + json.dumps({"bad": bad[:10], "n_bad": len(bad)}))
"""


def test_vllm_cpu_rope_strided_views():
    """vLLM 0.32's CPU rotary kernel on DeepSeek's strided q_pe / k_pe views
    rotates what emulate_mla's rule says, piece by piece (module docstring):
    a prompt's step of 40 tokens and a decode step at position 300."""
    import json
    import subprocess
    p = subprocess.run([sys.executable, "-c", _ROPE_PROBE, os.path.dirname(__file__)],
                       capture_output=True, text=True, timeout=300)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, p.stderr[-3000:]
    res = json.loads(line[7:])
    assert res["n_bad"] == 0, res


def _startup_error(log: str) -> str:
    return next(line for line in log.splitlines() if line.startswith("STARTUP_ERROR"))


def test_kvarn_mla_k4_g128(model, ref_fp32):
    """kvarn_mla_k4_g128 against vLLM's fp32 MLA cache (module docstring)."""
    import emulate_mla
    from kvarn_vllm import _lib
    layers, latent, rope = _dims(model)
    ref = ref_fp32[0]
    kv, log = run_llm(_cfg(model, kv_cache_dtype=MLA_FMT, block_size=G, fake_amx=True))
    # capacity: the KV budget less the fp32 tail pool (8 sequences' slots
    # of G tokens of every layer, latent + rope fp32), in blocks of one
    # record per layer
    fmt = _lib.mla_parse(MLA_FMT, latent, rope)
    rb = _lib.mla_record_bytes(fmt, latent, rope)
    pool = layers * 8 * G * (latent + rope) * 4
    assert kv["kv_blocks"] == ((1 << 30) - pool) // (layers * rb), kv["kv_blocks"]
    assert kv["kv_tokens"] == kv["kv_blocks"] * G
    seq = PROMPT + kv["outputs"][0]["token_ids"]
    exact = emulate_mla.logprobs(model, seq[:-1], PROMPT_LEN)
    codec = emulate_mla.logprobs(model, seq[:-1], PROMPT_LEN,
                                 roundtrip=emulate_mla.MlaCodec(MLA_FMT, latent, rope), G=G)
    mine = _lp_rows(kv)
    dec = slice(PROMPT_LEN - 1, None)    # decoded positions: they read records
    k_e = emulate_mla.kl_rows(exact, codec)[dec]
    k_v = emulate_mla.kl_rows(exact, mine)[dec]
    k_path = emulate_mla.kl_rows(codec, mine)[dec]
    k_pre = emulate_mla.kl_rows(exact, mine)[: PROMPT_LEN - 1]
    print(f"{MLA_FMT}: {rb} bytes per {G}-token record ({rb / G:.0f} per token per layer); "
          f"KV tokens {kv['kv_tokens']} against vLLM's fp32 cache {ref['kv_tokens']} "
          f"({kv['kv_tokens'] / ref['kv_tokens']:.2f}x); decode KLD over {len(k_v)} positions: "
          f"vLLM kvarn vs exact {k_v.mean():.5f} (max {k_v.max():.5f}), codec emulated "
          f"{k_e.mean():.5f} (max {k_e.max():.5f}), vLLM kvarn vs codec emulated "
          f"{k_path.mean():.2e}; prompt positions vs exact {k_pre.mean():.2e}")
    # the decoded positions read records: the codec's effect is there
    assert k_e.mean() > 0
    # one codec on the same latents on two hosts (test_families' rule) ...
    assert k_e.mean() / 2 <= k_v.mean() <= 2 * k_e.mean()
    # ... and position by position the same records and read rule: what
    # is left is fp32 summation order, far below the codec's effect
    assert k_path.mean() < k_e.mean() / 10
    # the prompt runs as MHA on the fresh latents: no codec effect
    assert k_pre.mean() < k_e.mean() / 10
    check_greedy_near_tie(ref, kv, k_e.max())


def test_kvarn_mla_slots_reused(model):
    """Three prompts one after another through one engine with one tail
    slot (max_num_seqs 1): each sequence ends mid-tile holding the slot,
    and the next must get it back (freed when vLLM hands its blocks out
    again, or when the slot's blocks are no longer any request's). Each
    sequence's decoded distributions are the emulated codec's on its own
    tokens (KL < its K_e / 10, as test_kvarn_mla_k4_g128). One at a time:
    vLLM 0.32's CPU RoPE depends on which tokens share a step
    (emulate_mla.py), which the emulation follows for one sequence alone."""
    import emulate_mla
    layers, latent, rope = _dims(model)
    lens = (G + 110, G - 8, 2 * G - 6)     # each crosses a tile boundary while decoding
    prompts = [_ids(20 + j, n) for j, n in enumerate(lens)]
    kv, _ = run_llm(_cfg(model, prompt_ids=prompts, kv_cache_dtype=MLA_FMT, block_size=G,
                         max_num_seqs=1, max_tokens=24))
    codec_fn = emulate_mla.MlaCodec(MLA_FMT, latent, rope)
    for prompt, out in zip(prompts, kv["outputs"]):
        P = len(prompt)
        seq = prompt + out["token_ids"]
        exact = emulate_mla.logprobs(model, seq[:-1], P)
        codec = emulate_mla.logprobs(model, seq[:-1], P, roundtrip=codec_fn, G=G)
        rows = np.array(out["prompt_logprobs"][1:] + out["logprobs"], dtype=np.float64)
        dec = slice(P - 1, None)
        k_e = emulate_mla.kl_rows(exact, codec)[dec]
        k_path = emulate_mla.kl_rows(codec, rows)[dec]
        print(f"prompt of {P}: decode KLD codec emulated {k_e.mean():.5f}, vLLM kvarn vs "
              f"codec emulated {k_path.mean():.2e}")
        assert k_e.mean() > 0
        assert k_path.mean() < k_e.mean() / 10


def test_kvarn_mla_batch(model):
    """Three prompts decoded in one batch (max_num_seqs 3: their steps
    shared, three tail slots in use, records of several sequences read in
    one step), with vLLM's RoPE made the trained model's (run_llm
    native_rope: forward_native for the CPU kernel, whose mis-rotation
    depends on which tokens share a step): each sequence's decoded
    distributions are the emulated codec's on its own tokens (emulate_mla
    with vllm_rope=False), KL < its K_e / 10."""
    import emulate_mla
    layers, latent, rope = _dims(model)
    lens = (2 * G + 110, G - 5, 3 * G - 20)   # each crosses a tile boundary too
    prompts = [_ids(30 + j, n) for j, n in enumerate(lens)]
    kv, _ = run_llm(_cfg(model, prompt_ids=prompts, kv_cache_dtype=MLA_FMT, block_size=G,
                         max_num_seqs=3, max_tokens=24, native_rope=True))
    codec_fn = emulate_mla.MlaCodec(MLA_FMT, latent, rope)
    for prompt, out in zip(prompts, kv["outputs"]):
        P = len(prompt)
        seq = prompt + out["token_ids"]
        exact = emulate_mla.logprobs(model, seq[:-1], P, vllm_rope=False)
        codec = emulate_mla.logprobs(model, seq[:-1], P, roundtrip=codec_fn, G=G,
                                     vllm_rope=False)
        rows = np.array(out["prompt_logprobs"][1:] + out["logprobs"], dtype=np.float64)
        dec = slice(P - 1, None)
        k_e = emulate_mla.kl_rows(exact, codec)[dec]
        k_path = emulate_mla.kl_rows(codec, rows)[dec]
        k_pre = emulate_mla.kl_rows(exact, rows)[: P - 1]
        print(f"batch, prompt of {P}: decode KLD codec emulated {k_e.mean():.5f}, vLLM kvarn "
              f"vs codec emulated {k_path.mean():.2e}; prompt vs exact {k_pre.mean():.2e}")
        assert k_e.mean() > 0
        assert k_path.mean() < k_e.mean() / 10
        assert k_pre.mean() < k_e.mean() / 10


def test_kvarn_kv_formats_refused_on_mla(model):
    layers, latent, rope = _dims(model)
    res, log = run_llm(_cfg(model, kv_cache_dtype="kvarn_k4v2_g128", block_size=G,
                            max_tokens=1), expect_ok=False)
    assert res is None
    err = _startup_error(log)
    assert "multi-head latent attention" in err, err
    assert f"{latent}-wide latent" in err and f"{rope}-wide RoPE key" in err, err
    assert MLA_FMT in err and "--kv-cache-dtype auto" in err, err


def test_mla_format_refused_without_mla(hf_model):
    res, log = run_llm(dict(model=hf_model, prompts=["x"], max_tokens=1,
                            kv_cache_dtype=MLA_FMT), expect_ok=False)
    assert res is None
    err = _startup_error(log)
    assert "has no MLA layers" in err and "kvarn_k4v2_g128" in err, err


@pytest.mark.parametrize("extra,needle", [
    (dict(kv_cache_dtype="kvarn_mla_k3_g128"), "accepted: kvarn_mla_k{2,4,8}"),
    (dict(kv_cache_dtype=MLA_FMT, speculative_config={"method": "ngram",
                                                      "num_speculative_tokens": 2,
                                                      "prompt_lookup_max": 3}),
     "speculative decoding with kvarn_mla_k4_g128"),
])
def test_mla_bad_setups_refused(model, extra, needle):
    res, log = run_llm(_cfg(model, block_size=G, max_tokens=1, **extra), expect_ok=False)
    assert res is None
    err = _startup_error(log)
    assert needle in err, err


def test_mla_unsupported_latent_refused(tmp_path):
    """A latent the MLA record cannot hold (384: not a power of two): the
    library's reason, at start-up."""
    cls, kw = make_models.FAMILIES["deepseek_v3"]
    make_models.FAMILIES["deepseek_v3_latent384"] = (cls, dict(kw, kv_lora_rank=384))
    try:
        m = make_models.make("deepseek_v3_latent384", str(tmp_path))
    finally:
        del make_models.FAMILIES["deepseek_v3_latent384"]
    res, log = run_llm(_cfg(m, kv_cache_dtype=MLA_FMT, block_size=G, max_tokens=1),
                       expect_ok=False)
    assert res is None
    err = _startup_error(log)
    assert "384-wide latent" in err and "power of two" in err, err
