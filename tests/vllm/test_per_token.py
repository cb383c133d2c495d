"""kvarn's per-token formats served as whole-cache dtypes (kvarn_int8,
kvarn_int4, kvarn_fp8_e4m3, kvarn_fp8_e5m2; docs/vllm.md "Per-token
formats"): the page is a block's per-token records, each token's record
written at its slot, attention over the records, no staging pool.

- SmolLM2: greedy tokens follow vLLM's own fp32 cache up to near-ties
  (conftest.check_greedy_near_tie's bound, k_e_max from the emulator on the
  same prompt), prefix caching on gives a warm prompt the tokens it had cold,
  and the KV tokens vLLM reports are the page arithmetic (1 GiB of blocks of
  Hk x block_size records of the format's bytes, nothing taken out), at
  vLLM's default block of 128 and at 16.
- A random-weight Llama-3 shape (make_models, vocabulary 2048, every
  logprob): test_families' KLD rule against the emulator (emulate.py
  TokenRecords: every token of every layer through the format's codec).
- The same rule with kvarn_int4 at TP=2 and kvarn_int8 at PP=2, the
  blocks each rank's own arithmetic.
- n-gram speculation (K 4) with kvarn_int8: drafts stored at their slots,
  rejected ones rewritten; greedy tokens by the near-tie rule.
- An MLA model with a per-token name is refused at configuration.
"""
import math
import os
import sys

import numpy as np
import pytest

from conftest import HF_MODEL, ROOT, run_llm

sys.path.insert(0, os.path.dirname(__file__))
import make_models  # noqa: E402

LAYERS, HK, D = 30, 3, 64          # SmolLM2-135M
# bytes of one token-head record (include/kvarn/record.h): int8 2D + 8,
# int4 D + 8, fp8 2D + 4
RECORD = {"kvarn_int8": lambda d: 2 * d + 8, "kvarn_int4": lambda d: d + 8,
          "kvarn_fp8_e4m3": lambda d: 2 * d + 4, "kvarn_fp8_e5m2": lambda d: 2 * d + 4}
LIB_NAME = {"kvarn_int8": "int8", "kvarn_int4": "int4", "kvarn_fp8_e4m3": "fp8_e4m3",
            "kvarn_fp8_e5m2": "fp8_e5m2"}
AUSTEN = os.path.join(ROOT, "data", "austen", "persuasion.txt")
MAX_TOKENS = 24


def _austen(chars: int, skip: int = 0) -> str:
    with open(AUSTEN, encoding="utf-8") as f:
        return f.read()[skip:skip + chars]


def _tokenize(texts):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(HF_MODEL)
    return [tok(t).input_ids for t in texts]


SHORT = ["The capital of France is", "Once upon a time, in a small village,"]
LONG = _austen(1500, 2000)   # ~330 tokens: two full blocks of 128 and a partial one


@pytest.fixture(scope="module")
def smol_ref(hf_model):
    ids = _tokenize(SHORT + [LONG])
    ref, _ = run_llm(dict(prompt_ids=ids, max_tokens=MAX_TOKENS, logprobs=2,
                          kv_cache_dtype="auto"))
    return ids, ref


@pytest.fixture(scope="module")
def smol(smol_ref):
    ids, ref = smol_ref
    base = dict(prompt_ids=ids, max_tokens=MAX_TOKENS, logprobs=2)
    out = {"ids": ids, "ref": ref}
    # prefix caching on: LONG again after the first round, its full blocks
    # found in the cache
    out["int8"], _ = run_llm(dict(base, kv_cache_dtype="kvarn_int8", prefix_caching=True,
                                  rounds=[{"prompt_ids": [ids[-1]]}]))
    return out


@pytest.fixture(scope="module")
def smol_k_e(smol):
    """The emulated codec's KL (whole vocabulary) per prompt position of
    LONG on SmolLM2 with kvarn_int8 (emulate.py TokenRecords)."""
    import emulate
    ids = smol["ids"][-1]
    exact = emulate.logprobs(HF_MODEL, ids, quantize=False)
    codec = emulate.logprobs(HF_MODEL, ids, quantize=True, per_token="int8")
    return emulate.kl_rows(exact, codec)


def _near_tie(ref_out, run_out, k_e_max: float) -> int:
    """check_greedy_near_tie's rule on run_llm's top-k logprobs (dicts
    keyed by token id strings): equal tokens, or where they first part the
    reference's margin between its token and the run's is at most
    sqrt(2 k), k = 2 k_e_max. Returns the first differing index (or the
    length)."""
    r, k = ref_out["token_ids"], run_out["token_ids"]
    i = next((j for j, (a, b) in enumerate(zip(r, k)) if a != b), None)
    if i is None:
        return len(r)
    lp = ref_out["logprobs"][i]
    a, b = str(r[i]), str(k[i])
    pb = math.exp(lp[b]) if b in lp else min(math.exp(v) for v in lp.values())
    margin = math.exp(lp[a]) - pb
    bound = math.sqrt(2 * 2 * k_e_max)
    print(f"greedy tokens first differ at {i}: reference margin {margin:.4f} <= {bound:.4f}")
    assert margin <= bound, (i, margin, bound)
    return i


def test_int8_follows_fp32_cache(smol, smol_k_e):
    k_e = smol_k_e[1:]
    print(f"kvarn_int8 on SmolLM2, emulated KL over {len(k_e)} positions: mean "
          f"{k_e.mean():.2e}, max {k_e.max():.2e}")
    for r, k in zip(smol["ref"]["outputs"], smol["int8"]["outputs"]):
        _near_tie(r, k, float(k_e.max()))
        assert r["token_ids"][:2] == k["token_ids"][:2]


def test_int8_prefix_caching_warm_follows_cold(smol, smol_k_e):
    """LONG again with its two full blocks from the prefix cache: the warm
    run reads the records the cold run wrote and computes only the rest.
    The two are not the same computation bit for bit (the cold prompt was
    prefilled in one batch with the short ones, the warm one alone: other
    row counts in the weight matmuls and in attention's work items), so the
    warm tokens follow the cold run's by the near-tie rule, whose bound a
    wrong block (another prompt's records, a stale slot) far exceeds."""
    cold = smol["int8"]["outputs"][-1]
    warm, = smol["int8"]["rounds"][0]
    assert cold["num_cached_tokens"] == 0
    assert warm["num_cached_tokens"] >= 256, warm["num_cached_tokens"]
    first = _near_tie(cold, warm, float(smol_k_e[1:].max()))
    assert first >= 2 and warm["token_ids"][:2] == cold["token_ids"][:2]


def test_int8_ngram_speculation_follows_fp32_cache(smol_ref):
    """vLLM's n-gram proposer (K 4) with kvarn_int8: every draft token's
    record is stored at its slot, a rejected one's slot written again by
    the next token there; greedy tokens follow the fp32 cache by the
    near-tie rule (k_e_max: a bound above the emulated int8 KL on SmolLM2,
    test_int8_follows_fp32_cache prints 0.0066), and drafts were accepted."""
    ids, ref = smol_ref
    kv, _ = run_llm(dict(prompt_ids=ids, max_tokens=MAX_TOKENS, logprobs=2,
                         kv_cache_dtype="kvarn_int8", stats=True,
                         speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                             "prompt_lookup_min": 2,
                                             "prompt_lookup_max": 4}))
    print("speculation stats:", {k: v for k, v in kv.items() if k not in ("outputs", "rounds")})
    m = kv["metrics"]
    # drafts were stored, some accepted, most rejected (their slots rewritten)
    assert m["vllm:spec_decode_num_draft_tokens"] > m["vllm:spec_decode_num_accepted_tokens"] > 0
    for r, k in zip(ref["outputs"], kv["outputs"]):
        assert len(k["token_ids"]) == MAX_TOKENS
        _near_tie(r, k, 0.01)


def _blocks(name: str, block: int, budget: int = 2**30) -> int:
    return budget // (LAYERS * HK * block * RECORD[name](D))


def test_int8_kv_tokens_are_the_page_arithmetic(smol):
    kv = smol["int8"]
    assert kv["kv_blocks"] == _blocks("kvarn_int8", 128)
    assert kv["kv_tokens"] == kv["kv_blocks"] * 128
    # vLLM's own fp32 cache (the model's dtype) at the same budget
    ref = smol["ref"]["kv_tokens"]
    assert ref == 2**30 // (LAYERS * HK * 2 * D * 4 * 128) * 128
    print(f"KV tokens at 1 GiB: fp32 cache {ref}, kvarn_int8 {kv['kv_tokens']} "
          f"({kv['kv_tokens'] / ref:.2f}x)")


def test_int4_block_16(hf_model):
    """kvarn_int4 with --block-size 16: the page arithmetic at 16-token
    blocks, and a prompt over many blocks served to its last token."""
    kv, _ = run_llm(dict(prompts=[LONG], max_tokens=8, kv_cache_dtype="kvarn_int4",
                         block_size=16))
    assert kv["kv_blocks"] == _blocks("kvarn_int4", 16)
    assert kv["kv_tokens"] == kv["kv_blocks"] * 16
    assert len(kv["outputs"][0]["token_ids"]) == 8
    print(f"kvarn_int4, blocks of 16: {kv['kv_tokens']} KV tokens at 1 GiB")


def test_block_size_not_a_multiple_of_16_refused(hf_model):
    res, log = run_llm(dict(prompts=["x"], max_tokens=1, kv_cache_dtype="kvarn_int8",
                            block_size=24), expect_ok=False)
    assert res is None
    assert "multiple of 16" in log, log[-3000:]


# ---------------------------------------------------------------- KLD rule
VOCAB = make_models.VOCAB
PROMPT_LEN = 400


def _ids(seed: int, n: int) -> list:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(3, VOCAB, n)]


PROMPT = _ids(1, PROMPT_LEN)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    model = make_models.make("llama3", str(tmp_path_factory.mktemp("per_token")))
    base = dict(model=model, prompt_ids=[PROMPT], max_tokens=16, logprobs=VOCAB,
                prompt_logprobs=VOCAB, max_logprobs=VOCAB, dense_logprobs=VOCAB)
    ref, _ = run_llm(dict(base, kv_cache_dtype="auto"))
    return model, base, ref


_EMULATED = {}                   # (model, library format) -> (exact, codec) log-probs


def _check_kld(name: str, model: str, ref: dict, kv: dict, blocks: int) -> None:
    """test_families' rule: vLLM's KLD to its fp32 cache (K_v) within the
    codec's own effect of the emulated one (K_e): |K_v - K_e| <= K_e and
    K_v >= K_e / 2; greedy tokens by check_greedy_near_tie; vLLM's KV
    tokens are `blocks` blocks of 128."""
    import emulate
    from conftest import check_greedy_near_tie
    key = (model, LIB_NAME[name])
    if key not in _EMULATED:
        _EMULATED[key] = (emulate.logprobs(model, PROMPT, quantize=False),
                          emulate.logprobs(model, PROMPT, quantize=True,
                                           per_token=LIB_NAME[name]))
    exact, codec = _EMULATED[key]
    k_e = emulate.kl_rows(exact, codec)[:PROMPT_LEN - 1]
    P = np.array(ref["outputs"][0]["prompt_logprobs"][1:], dtype=np.float64)
    Q = np.array(kv["outputs"][0]["prompt_logprobs"][1:], dtype=np.float64)
    k_v = np.sum(np.exp(P) * (P - Q), axis=-1)
    k_ref = np.sum(np.exp(exact[:PROMPT_LEN - 1]) * (exact[:PROMPT_LEN - 1] - P), axis=-1)
    print(f"{name}: KLD over {len(k_v)} positions: vLLM vs fp32 {k_v.mean():.3e} (max "
          f"{k_v.max():.3e}); emulated {k_e.mean():.3e} (max {k_e.max():.3e}); vLLM fp32 vs "
          f"transformers {k_ref.mean():.2e}; KV tokens fp32 {ref['kv_tokens']}, {name} "
          f"{kv['kv_tokens']}")
    assert kv["kv_tokens"] == blocks * 128
    assert k_ref.mean() < k_e.mean() / 10
    assert k_e.mean() / 2 <= k_v.mean() <= 2 * k_e.mean()
    check_greedy_near_tie(ref, kv, k_e.max())


def _llama3_shape() -> tuple:
    cfg = make_models.FAMILIES["llama3"][1]
    return cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]


@pytest.mark.parametrize("name", ["kvarn_int8", "kvarn_int4", "kvarn_fp8_e4m3",
                                  "kvarn_fp8_e5m2"])
def test_kld_matches_emulator(name, llama3):
    model, base, ref = llama3
    kv, _ = run_llm(dict(base, kv_cache_dtype=name))
    nl, hk, d = _llama3_shape()
    _check_kld(name, model, ref, kv, 2**30 // (nl * hk * 128 * RECORD[name](d)))


# tensor and pipeline parallelism (test_parallel.py's settings): each rank
# holds the records of its own KV heads (TP) and of its own layers (PP);
# every rank sizes its blocks from its own 1 GiB and vLLM keeps the fewest
PARALLEL = {
    # TP=2: one of the model's 2 KV heads per rank, every layer
    "tp2": ("kvarn_int4", dict(tensor_parallel_size=2), lambda nl, hk: [(nl, hk // 2)] * 2),
    # PP=2: vLLM's get_pp_indices splits the layers, the first stage one more
    "pp2": ("kvarn_int8", dict(pipeline_parallel_size=2),
            lambda nl, hk: [(nl - nl // 2, hk), (nl // 2, hk)]),
}


@pytest.mark.parametrize("par", list(PARALLEL))
def test_parallel_kld_matches_emulator(par, llama3):
    """kvarn_int4 at TP=2 and kvarn_int8 at PP=2 on the Llama-3 shape: the
    blocks are the per-rank page arithmetic (the fewest of the ranks'), and
    the KLD and greedy rules of test_kld_matches_emulator hold against the
    same emulated codec (a rank that stored another rank's heads or layers,
    or read the wrong records, fails the KLD rule)."""
    from conftest import PP_COMPILE, bind_threads
    from vllm.distributed.utils import get_pp_indices
    name, kw, ranks = PARALLEL[par]
    world = kw.get("tensor_parallel_size", 1) * kw.get("pipeline_parallel_size", 1)
    if "pipeline_parallel_size" in kw:
        kw = dict(kw, **PP_COMPILE)
    model, base, ref = llama3
    kv, _ = run_llm(dict(base, kv_cache_dtype=name, env=bind_threads(world), **kw))
    nl, hk, d = _llama3_shape()
    per_rank = ranks(nl, hk)
    if "pipeline_parallel_size" in kw:
        assert [b - a for a, b in (get_pp_indices(nl, r, 2) for r in range(2))] == \
            [layers for layers, _ in per_rank]
    _check_kld(name, model, ref, kv, min(2**30 // (layers * h * 128 * RECORD[name](d))
                                         for layers, h in per_rank))


def test_per_token_refused_on_mla(tmp_path_factory):
    model = make_models.make("deepseek_v3", str(tmp_path_factory.mktemp("mla_pt")))
    res, log = run_llm(dict(model=model, prompt_ids=[PROMPT[:8]], max_tokens=1,
                            kv_cache_dtype="kvarn_int8"), expect_ok=False)
    assert res is None
    err = next(line for line in log.splitlines() if line.startswith("STARTUP_ERROR"))
    assert "per-token format" in err and "multi-head latent attention" in err, err
    assert "--kv-cache-dtype auto" in err, err


def test_tile_settings_refused(hf_model):
    """KVARN_STAGING / KVARN_SINK_TOKENS (the tile formats' staging pool
    and sink) with a per-token name: refused at configuration, naming
    each setting and that it does not apply (settings.TILE_SETTINGS)."""
    res, log = run_llm(dict(prompts=["x"], max_tokens=1, kv_cache_dtype="kvarn_int8",
                            env={"KVARN_STAGING": "fp16", "KVARN_SINK_TOKENS": "4"}),
                       expect_ok=False)
    assert res is None
    err = next(line for line in log.splitlines() if line.startswith("STARTUP_ERROR"))
    assert "KVARN_SINK_TOKENS=4, KVARN_STAGING=fp16 does not apply" in err, err
    assert "kvarn_int8 writes each token's record at once" in err, err
