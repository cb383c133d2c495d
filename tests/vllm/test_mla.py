"""MLA (DeepSeek-V3/R1, Kimi-K2 attention) through vLLM 0.32's CPU build, on
a random-weight model of DeepSeek-V3's attention shape (make_models.py
"deepseek_v3": per token one 512-wide latent and one 64-wide RoPE key).

vLLM's own cache: the CPU platform picks its MLA backend (CPU_MLA; AMX_MLA
where the CPU has AMX tiles), forces blocks of 16 tokens and turns chunked
prefill and prefix caching off; the prompt runs as MHA on the fresh
latents, each decoded token as absorbed MQA over the cache. Checked here:
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

The kvarn formats store K and V tiles per KV head, which an MLA model has
none of: a kvarn --kv-cache-dtype on an MLA model is refused at start-up
with the reason (plugin.check_model -> mla_backend.check_mla_model).
"""
import os
import sys

import numpy as np
import pytest

from conftest import run_llm

sys.path.insert(0, os.path.dirname(__file__))
import make_models  # noqa: E402

VOCAB = make_models.VOCAB
G = 128
PROMPT_LEN = 2 * G + 100     # decoding crosses the tile boundary at 3G
MAX_TOKENS = 40
MLA_BLOCK = 16               # vLLM's CPU platform forces it for MLA (platforms/cpu.py)


def _ids(seed: int, n: int) -> list:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(3, VOCAB, n)]


PROMPT = _ids(11, PROMPT_LEN)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_models.make("deepseek_v3", str(tmp_path_factory.mktemp("mla")))


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


def _expected_backend() -> str:
    import torch
    return "AMX_MLA" if torch.cpu._is_amx_tile_supported() else "CPU_MLA"


def test_vllm_own_mla_cache(model):
    layers, latent, rope = _dims(model)
    runs = {}
    for dtype, elt in (("float32", 4), ("bfloat16", 2)):
        res, log = run_llm(_cfg(model, kv_cache_dtype="auto", dtype=dtype))
        assert f"Using {_expected_backend()} backend" in log
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


@pytest.mark.parametrize("dtype", ["kvarn_k4v2_g128"])
def test_kvarn_formats_refused_on_mla(model, dtype):
    layers, latent, rope = _dims(model)
    res, log = run_llm(_cfg(model, kv_cache_dtype=dtype, block_size=G, max_tokens=1),
                       expect_ok=False)
    assert res is None
    err = next(line for line in log.splitlines() if line.startswith("STARTUP_ERROR"))
    assert "multi-head latent attention" in err, err
    assert f"{latent}-wide latent" in err and f"{rope}-wide RoPE key" in err, err
    assert "--kv-cache-dtype auto" in err, err
