"""Tensor and pipeline parallelism on vLLM's CPU build (docs/vllm-models.md "Tensor
and pipeline parallelism"): each rank holds the records of its own KV heads
(TP) and of its own layers (PP), and its own staging pool sized for
them, taken out of its own KV budget.

Configurations (each engine in a fresh process, conftest.run_llm):
  SmolLM2-135M (3 KV heads, 30 layers): TP=1 with vLLM's cache and with
  kvarn, TP=3 (one KV head per rank), PP=2 (15 layers per stage);
  a random-weight Llama made here (8 query / 4 KV heads, 4 layers): kvarn
  at TP=1 and TP=2 (two KV heads per rank), capacity only (see rand).

What is checked, per parallel run against TP=1 of the same format:
  - vLLM's block count is the per-rank arithmetic: (budget - pool) //
    (layers x Hk x record bytes) with this rank's Hk / TP heads and this
    stage's layers, and every rank logs that pool;
  - the teacher-forced log-probs of one 640-token text: the KLD D between
    kvarn at TP=1 and kvarn at TP/PP is at most kvarn's own KLD K1 to
    vLLM's cache at TP=1 (why: see _kld_checks), and kvarn at TP/PP is as
    far from vLLM's cache as kvarn at TP=1 (|K_par - K1| <= K1, the rule
    test_llama uses for two paths of one format);
  - greedy outputs equal TP=1's up to a near-tie: where they first differ,
    TP=1's margin p(a) - p(b) is <= sqrt(2 D_max) (Pinsker, as
    test_serve._follows);
  - the records themselves (KVARN_TEST_COMMIT_LOG, every rank's log named
    by its TP and PP rank): each (layer, tile, KV head) record of the
    parallel run against TP=1's, code byte by code byte (_record_problems):
    in layer 0, whose inputs are the same up to the GEMM's summation order,
    all but a float-noise fraction equal; in every layer, TP=1's record of
    the same (layer, tile, head) is by far the nearest of all its (tile,
    head) records of that layer. A head, tile or layer mix-up (planted in
    test_record_check_catches_mixups) fails both.

vLLM 0.32's CPU build needs two things here (docs/vllm.md): one CPU list per
local rank in VLLM_CPU_OMP_THREADS_BIND when there are fewer NUMA nodes than
ranks (its automatic binding asserts one node per rank), and for PP a
torch.compile mode (here Dynamo with the eager backend): with
enforce_eager its CPU worker skips the warm-up run that allocates the
buffer the later stages receive activations into, and the first step fails
in gpu_model_runner.sync_and_gather_intermediate_tensors
(`assert self.intermediate_tensors is not None`), with vLLM's own cache as
with kvarn.
"""
import ctypes
import glob
import math
import os
import re
import shutil

import pytest

from conftest import (bind_threads, folded_kld, PP_COMPILE, ROOT, run_llm,
                      staging_pool_bytes, VLLM_CPU_BATCHED)

KV = "kvarn_k4v2_g128"
G = 128
RECORD = 7296            # kvarn_k4v2_g128 record bytes at D = 64 (spec worked sizes)
BUDGET = 256 * 2**20     # KV budget per worker (kv_cache_memory_bytes)
SEQS = 8                 # max_num_seqs: the pool holds SEQS x (sink + tail) tiles
TEXT_TOKENS = 640        # teacher-forced text: 5 tiles
FROM = 2 * G             # positions compared: from tile 2 on, where queries read records
AUSTEN = os.path.join(ROOT, "data", "austen", "persuasion.txt")
SHORT = ["The capital of France is", "Once upon a time, in a small village,",
         "def fibonacci(n):"]


def _text_ids(model):
    from transformers import AutoTokenizer
    with open(AUSTEN, encoding="utf-8") as f:
        text = f.read()[:4000]
    ids = AutoTokenizer.from_pretrained(model)(text)["input_ids"][:TEXT_TOKENS]
    assert len(ids) == TEXT_TOKENS
    return ids


def _runs(model, configs):
    """One engine per configuration: the 640-token text teacher-forced
    (prompt_logprobs) and the short prompts greedy, 24 tokens."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [_text_ids(model)] + [tok(s)["input_ids"] for s in SHORT]
    base = dict(model=model, prompt_ids=prompts, max_tokens=24, logprobs=20,
                max_logprobs=100, kv_cache_memory_bytes=BUDGET, max_num_seqs=SEQS)
    out = {}
    for name, cfg in configs.items():
        # vLLM's cache as the reference gives its top 20; kvarn its top 100,
        # so that the reference's top 20 are (nearly always) among them
        lp = 20 if cfg["kv_cache_dtype"] == "auto" else 100
        res, log = run_llm(dict(base, prompt_logprobs=lp, **cfg))
        res["log"] = log
        out[name] = res
    return out


def _smollm_configs(logs):
    """logs: the commit-log prefix of each kvarn run (the test compares
    their records); vLLM's cache has none."""
    log = lambda name: {"KVARN_TEST_COMMIT_LOG": os.path.join(logs, name)}
    return {"ref": dict(kv_cache_dtype="auto"),
            "kv1": dict(kv_cache_dtype=KV, env=log("kv1")),
            "tp3": dict(kv_cache_dtype=KV, tensor_parallel_size=3,
                        env=dict(bind_threads(3), **log("tp3"))),
            "pp2": dict(kv_cache_dtype=KV, pipeline_parallel_size=2,
                        env=dict(bind_threads(2), **log("pp2")), **PP_COMPILE)}


@pytest.fixture(scope="module")
def smollm(hf_model, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("commit_logs"))
    runs = _runs(hf_model, _smollm_configs(logs))
    for name in ("kv1", "tp3", "pp2"):
        runs[name]["records"] = _read_records(os.path.join(logs, name))
    return runs


# the random model: 8 query heads, 4 KV heads of 64, 4 layers, SmolLM2's
# vocabulary and tokenizer; weights of std 0.2 (transformers' default 0.02
# gives next-token distributions near uniform over 49152 tokens, whose top
# 20 hold 0.2% of the mass; at 0.2 they hold ~75%, as a trained model's do,
# so the top-20 KLD below measures something)
RAND = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
            intermediate_size=1024, num_hidden_layers=4, initializer_range=0.2)


@pytest.fixture(scope="module")
def random_model(hf_model, tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    d = tmp_path_factory.mktemp("rand_llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, rope_theta=100000.0, **RAND)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(d)
    for f in os.listdir(hf_model):
        if f.startswith("tokenizer"):
            shutil.copy(os.path.join(hf_model, f), d / f)
    return str(d)


@pytest.fixture(scope="module")
def rand(random_model):
    # capacity only: at std 0.2 its attention is so sharp that k4v2 moves the
    # next-token distributions far (vLLM cache vs kvarn TP=1: the reference's
    # top 20 are not among kvarn's top 100 past tile 2), so the KLD checks
    # below say nothing on it; a random model fit for them is left to do
    return _runs(random_model, {
        "kv1": dict(kv_cache_dtype=KV),
        "tp2": dict(kv_cache_dtype=KV, tensor_parallel_size=2, env=bind_threads(2))})


# ----------------------------------------------------------------- capacity
def _pool(layers, hk, world, d=64):
    """The staging pool of one rank (conftest.staging_pool_bytes: SEQS x
    (1 sink + 1 tail) int8 tiles of this rank's layers and KV heads, and the
    scratch for vLLM's max_num_batched_tokens, 4096 per rank)."""
    return staging_pool_bytes(layers, hk, d, SEQS, batched=VLLM_CPU_BATCHED * world)


def _check_capacity(res, layers, hk, world):
    pool = _pool(layers, hk, world)
    blocks = (BUDGET - pool) // (layers * hk * RECORD)
    assert res["kv_blocks"] == blocks, (res["kv_blocks"], blocks)
    # every rank took its own pool out of its own budget
    line = f"kvarn: int8 staging pool {pool / 2**20:.1f} MiB"
    logged = [ln for ln in res["log"].splitlines() if "kvarn: int8 staging pool" in ln]
    assert len(logged) == world and all(line in ln for ln in logged), logged
    print(f"{world} ranks x ({layers} layers, {hk} KV heads): pool {pool / 2**20:.1f} MiB "
          f"per rank, {blocks} blocks = {blocks * G} KV tokens")


def test_capacity_per_rank_smollm(smollm):
    """TP=1: 30 layers x 3 heads; TP=3: 30 x 1 per rank; PP=2: 15 x 3 per
    stage. If the pool or the pages were sized with the whole model's heads
    or layers, the block count would differ (e.g. TP=3 would keep about a
    third of its blocks)."""
    _check_capacity(smollm["kv1"], 30, 3, 1)
    _check_capacity(smollm["tp3"], 30, 1, 3)
    _check_capacity(smollm["pp2"], 15, 3, 2)


def test_capacity_per_rank_random_tp2(rand):
    _check_capacity(rand["kv1"], 4, 4, 1)
    _check_capacity(rand["tp2"], 4, 2, 2)


# ---------------------------------------------------------------- accuracy
def _kl_positions(P, Q):
    """Per-position KL(P || Q) over the text's positions FROM.., P's top 20
    and the rest folded into one bucket (a lower bound of the full KL, data
    processing); positions where Q lacks one of P's top 20 are skipped."""
    kls = folded_kld(P, Q, FROM + 1)
    assert len(kls) >= (TEXT_TOKENS - FROM) * 3 // 4, len(kls)
    return kls


def _first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _kld_checks(runs, par):
    """D = KLD(kvarn TP=1 || kvarn parallel), K1 = KLD(vLLM TP=1 || kvarn
    TP=1), K_par = KLD(vLLM TP=1 || kvarn parallel), means over the text.

    Bound D <= K1: a parallel run computes every head's K/V with the same
    weights, its sums in another order (fp32, relative changes ~1e-6), so
    the records hold the same codes except where a value sits within that
    change of a rounding boundary: a fraction f ~ 2 |dx| / step of the codes
    move by one step, an error of one step where the TP=1 cache had one of
    at most half a step. To second order KL grows with the squared error,
    so D / K1 ~ (f n step^2) / (n step^2 / 12) = 12 f, below 1 unless one
    code in twelve moves; a rank reading another rank's heads, another
    stage's layers or another rank's staging slots gives errors of the size
    of the values themselves, far above K1."""
    ref, kv1, p = (runs[k]["outputs"] for k in ("ref", "kv1", par))
    D = _kl_positions(kv1[0]["prompt_logprobs"], p[0]["prompt_logprobs"])
    K1 = _kl_positions(ref[0]["prompt_logprobs"], kv1[0]["prompt_logprobs"])
    Kp = _kl_positions(ref[0]["prompt_logprobs"], p[0]["prompt_logprobs"])
    d, k1, kp = (sum(x) / len(x) for x in (D, K1, Kp))
    print(f"{par}: KLD mean over positions {FROM}..{TEXT_TOKENS - 1}: kvarn TP=1 vs {par} "
          f"{d:.3g} (max {max(D):.3g}), vLLM cache vs kvarn TP=1 {k1:.4g}, "
          f"vLLM cache vs kvarn {par} {kp:.4g}")
    assert k1 > 0
    assert d <= k1
    assert abs(kp - k1) <= k1
    # greedy: equal up to a near-tie of TP=1 (Pinsker, test_serve._follows),
    # k the largest per-position D of the text
    bound = math.sqrt(2 * max(D))
    same = 0
    for a, b in zip(kv1, p):
        i = _first_divergence(a["token_ids"], b["token_ids"])
        if i == len(a["token_ids"]):
            same += 1
            continue
        lp = a["logprobs"][i]
        x, y = str(a["token_ids"][i]), str(b["token_ids"][i])
        py = math.exp(lp[y]) if y in lp else min(math.exp(v) for v in lp.values())
        margin = math.exp(lp[x]) - py
        print(f"{par}: first divergence at token {i}: TP=1 margin {margin:.2e}, "
              f"bound {bound:.2e}")
        assert margin <= bound, (i, margin, bound)
    print(f"{par}: {same} of {len(kv1)} greedy outputs equal to TP=1's over 24 tokens")


def test_tp3_smollm_matches_tp1(smollm):
    _kld_checks(smollm, "tp3")


def test_pp2_smollm_matches_tp1(smollm):
    _kld_checks(smollm, "pp2")



# ----------------------------------------------------------------- records
SMOLLM_LAYERS, SMOLLM_HK, HEAD_DIM = 30, 3, 64
# Layer 0's K/V are the same function of the token ids on every rank: the
# same RMSNorm, then this rank's columns of the same K/V projection, whose
# fp32 sums TP may block differently: a relative change of ~sqrt(n) u =
# sqrt(576) 2^-24 = 1.4e-6 of the products' magnitude. A code moves only
# where its value lies that close to a rounding boundary, a fraction ~2 x
# 1.4e-6 x 24 (products' magnitude over the row range: sqrt(576) for
# sums of unrelated signs) x (2^bits - 1) of the codes: 1.0e-3 of the 4-bit
# keys, 2e-4 of the 2-bit values, so under 0.4% of the code bytes (2 or 4
# codes each). Allowed: 2%. Measured here: 0 (bit-identical); records of
# another head or tile differ in 96-99% of their code bytes.
LAYER0_NOISE = 0.02


class _RecordLayout(ctypes.Structure):
    """include/kvarn/record.h kvarn_record_layout."""
    _fields_ = ([(n, ctypes.c_int) for n in ("head_dim", "tile_tokens", "key_bits",
                                            "value_bits")] +
                [(n, ctypes.c_size_t) for n in (
                    "k_codes_off", "k_codes_bytes", "k_a_off", "k_a_bytes", "k_b_off",
                    "k_b_bytes", "k_stok_off", "k_stok_bytes", "v_codes_off", "v_codes_bytes",
                    "v_schan_off", "v_schan_bytes", "v_a_off", "v_a_bytes", "v_b_off",
                    "v_b_bytes", "v_mu_off", "v_mu_bytes", "payload_bytes", "record_bytes")])


def _code_bytes(fmt_name: str, d: int):
    """Offsets of the K and V code bytes in one record (the library's
    kvarn_record_layout_get) and the record's size."""
    import numpy as np
    from kvarn_vllm import _lib
    fmt = _lib.parse_format(fmt_name, d)
    lay = _RecordLayout()
    _lib.check(_lib.lib().kvarn_record_layout_get(ctypes.byref(fmt), d, ctypes.byref(lay)),
               "record layout")
    idx = np.r_[lay.k_codes_off:lay.k_codes_off + lay.k_codes_bytes,
                lay.v_codes_off:lay.v_codes_off + lay.v_codes_bytes]
    return idx, lay.record_bytes


def _read_records(prefix: str) -> dict:
    """{(tp rank, pp rank): {block: uint8 [records, record bytes]}} from a
    run's commit logs (backend.py: one log per rank, its records layer by
    layer, each layer's KV heads in order). A block logged more than once
    keeps its last record (test_spec_decode._read_log says why)."""
    import numpy as np
    _, rb = _code_bytes(KV, HEAD_DIM)
    out = {}
    for f in glob.glob(prefix + ".tp*.pp*.*"):
        m = re.fullmatch(re.escape(prefix) + r"\.tp(\d+)\.pp(\d+)\.\d+", f)
        if m is None:
            continue
        data = open(f + ".bin", "rb").read()
        recs = out.setdefault((int(m[1]), int(m[2])), {})
        for line in open(f):
            if line.startswith("record "):
                _, _, block, off, n = line.split()
                raw = np.frombuffer(data[int(off):int(off) + int(n)], dtype=np.uint8)
                recs[int(block)] = raw.reshape(-1, rb)
    assert out, f"no commit log at {prefix}.tp*.pp*.*"
    return out


def _record_problems(ref: dict, par: dict, tp: int, pp: int, layers: int = SMOLLM_LAYERS,
                     hk: int = SMOLLM_HK):
    """ref: the TP=1 run's records {block: [layers * hk, bytes]}; par: a
    run's over tp x pp ranks (_read_records), rank (t, p) holding layers
    [p L/pp, (p+1) L/pp) and KV heads [t hk/tp, (t+1) hk/tp). Each of its
    (layer, tile, head) records is compared, code byte by code byte, with
    every (tile, head) record of that layer at TP=1: f the fraction of code
    bytes that differ from TP=1's same (layer, tile, head), n the smallest
    over the others. A problem: the ranks or the blocks logged differ; in
    layer 0, f > LAYER0_NOISE; in any layer, f >= n / 2 (float noise
    cascades through the layers, by the codes it moves (docs/vllm-models.md
    "Tensor and pipeline parallelism": up to 17% of the code bytes of
    SmolLM2's deep layers on the test's text), but a record of another
    head or tile differs in 96-99%). Returns (problems, per-layer largest
    f)."""
    import numpy as np
    idx, _ = _code_bytes(KV, HEAD_DIM)
    blocks = sorted(ref)
    R = np.stack([ref[b].reshape(layers, hk, -1)[:, :, idx] for b in blocks])  # [B, L, H, C]
    worst = np.zeros(layers)
    problems = []
    ranks = [(t, p) for t in range(tp) for p in range(pp)]
    if sorted(par) != ranks:
        return [f"ranks logged {sorted(par)}, expected {ranks}"], worst
    lps, hpr = layers // pp, hk // tp
    for (t, p), recs in sorted(par.items()):
        if sorted(recs) != blocks:
            problems.append(f"rank tp{t} pp{p}: blocks {sorted(recs)}, TP=1 {blocks}")
            continue
        for i, b in enumerate(blocks):
            x = recs[b].reshape(lps, hpr, -1)[:, :, idx]
            for l in range(lps):
                L = p * lps + l
                for j in range(hpr):
                    h = t * hpr + j
                    diff = (R[:, L] != x[l, j]).mean(axis=-1)  # [B, H]
                    f = diff[i, h]
                    diff[i, h] = np.inf
                    n = diff.min()
                    worst[L] = max(worst[L], f)
                    if L == 0 and f > LAYER0_NOISE:
                        problems.append(f"layer 0 block {b} head {h}: {f:.4f} of the code bytes "
                                        f"differ (> {LAYER0_NOISE})")
                    if not f < n / 2:
                        problems.append(f"layer {L} block {b} head {h}: {f:.4f} of the code bytes "
                                        f"differ from TP=1's, {n:.4f} from its nearest other "
                                        "(tile, head)")
    return problems, worst


def _check_records(runs, par, tp, pp):
    problems, worst = _record_problems(runs["kv1"]["records"][(0, 0)], runs[par]["records"],
                                       tp, pp)
    n = len(runs["kv1"]["records"][(0, 0)])
    print(f"{par}: {n} tiles x {SMOLLM_LAYERS} layers x {SMOLLM_HK} heads; largest fraction "
          "of code bytes differing from TP=1, per layer: " + " ".join(f"{w:.3f}" for w in worst))
    assert n >= TEXT_TOKENS // G
    assert not problems, problems[:10]


def test_tp3_records_match_tp1(smollm):
    _check_records(smollm, "tp3", 3, 1)


def test_pp2_records_match_tp1(smollm):
    _check_records(smollm, "pp2", 1, 2)


def test_record_check_catches_mixups(smollm):
    """The check above, on mix-ups planted in the TP=3 / PP=2 records: two
    ranks' heads swapped, two tiles of one rank swapped, the stages' layers
    swapped, one layer of one rank holding its next layer's record."""
    ref = smollm["kv1"]["records"][(0, 0)]
    tp3, pp2 = smollm["tp3"]["records"], smollm["pp2"]["records"]
    heads = dict(tp3)
    heads[(0, 0)], heads[(1, 0)] = tp3[(1, 0)], tp3[(0, 0)]
    tiles = dict(tp3)
    b0, b1 = sorted(tp3[(2, 0)])[:2]
    tiles[(2, 0)] = dict(tp3[(2, 0)])
    tiles[(2, 0)][b0], tiles[(2, 0)][b1] = tp3[(2, 0)][b1], tp3[(2, 0)][b0]
    stages = {(0, 0): pp2[(0, 1)], (0, 1): pp2[(0, 0)]}
    layer = dict(tp3)
    layer[(1, 0)] = {b: r.copy() for b, r in tp3[(1, 0)].items()}
    for r in layer[(1, 0)].values():
        r[5] = r[6]   # rank 1 (one head), layer 5 holds layer 6's record
    for name, par, tp, pp in (("heads", heads, 3, 1), ("tiles", tiles, 3, 1),
                              ("stages", stages, 1, 2), ("layer", layer, 3, 1)):
        problems, _ = _record_problems(ref, par, tp, pp)
        print(f"planted {name} mix-up: {len(problems)} problems, e.g. {problems[:1]}")
        assert problems, name
