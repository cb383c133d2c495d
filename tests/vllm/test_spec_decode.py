"""Speculative decoding through the kvarn cache (docs/vllm-models.md "Speculative
decoding"): vLLM's n-gram proposer drafts k tokens a step, the verification
step sends 1 + k causal queries per sequence through the same attention path
as a prefill chunk, and a tile is committed only from accepted tokens.

The prompts are token ids cut from a repeated Austen passage (so n-gram
proposals hit) and from plain text (so they miss), at lengths that make the
drafts cross the tile boundaries at 128 and 256 tokens. Checked: greedy tokens
with speculation equal those without, for every preset, up to near-ties
(below); the committed records (KVARN_TEST_COMMIT_LOG) hold the plain run's
keys, so no rejected draft reached a record; and the run did hit the cases
that matter (tiles encoded from drafts, some of them written again after a
rejection, some confirmed).

Near-ties. Speculation reads the same cache another way: a verification step
computes K/V and logits for 1 + k rows at once and attends through the
prefill-chunk kernels, where plain decoding has one row and the decode
kernels. Both are exact up to float rounding and the staged tokens' own
quantization, but not the same roundings, and an encoder rounding that lands
on the other side of a code boundary moves a code. So the log-probabilities
of the two runs differ a little (SmolLM2, kvarn_k4v2_g128, an AVX2-only
EPYC: median 0.001 nats, largest 0.13, about a third of what the codec
itself moves them), and where the top two tokens are that close the greedy
choice can flip, after which the two texts go their own ways (3 of the 8
prompts there; none on an AVX-512 Zen 4). A flip is accepted only as such a
near-tie: with a = plain's token and b = speculation's at the first
difference, the move it takes, (lp_plain(a) - lp_plain(b)) + (lp_spec(b) -
lp_spec(a)), is a change of two log-probabilities, so at most twice the
largest change of one (the chosen token's) seen at the positions where the
runs agree. And those changes must be smaller, on average, than the codec's
own (the mean |lp_kvarn - lp_exact| of the plain run against vLLM's fp32
cache): a rejected draft in the cache is a whole wrong token, not a
rounding."""
import collections
import glob
import json
import os

import pytest

from conftest import ROOT, run_llm

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
G = 128


def _tokenize(text):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(ROOT, "models", "SmolLM2-135M-Instruct-hf",
                                           "tokenizer.json"))
    return tok.encode(text, add_special_tokens=False).ids


def prompt_ids(tile=G):
    """Eight prompts: a repeated passage ending 10 tokens before tile 1 and
    before tile 2 (n-gram drafts cross the boundary, mostly accepted), and
    six cuts of plain prose (drafts from its common word pairs, mostly
    rejected) of 100-125 tokens, so that decoding crosses tiles 1 and 2."""
    austen = open(os.path.join(ROOT, "data", "austen", "emma.txt"), encoding="utf-8").read()
    passage = _tokenize(austen[20000:20600])
    rep = passage * 20
    out = [rep[:tile - 10], rep[:2 * tile - 10]]
    for j in range(6):
        plain = _tokenize(austen[40000 + 7000 * j:46000 + 7000 * j])
        out.append(plain[:tile - 28 + 5 * j])
    return out


TOP = 5   # log-probabilities kept per position


def _run(fmt, spec, log=None, max_tokens=176, block=G, prefix_caching=True):
    cfg = {"kv_cache_dtype": fmt, "block_size": block, "prompt_ids": prompt_ids(block),
           "max_tokens": max_tokens, "ignore_eos": True, "prefix_caching": prefix_caching,
           "max_num_seqs": 8, "stats": fmt != "auto", "logprobs": TOP}
    if spec:
        cfg["speculative_config"] = NGRAM
    if log:
        cfg["env"] = {"KVARN_TEST_COMMIT_LOG": log}
    res, _ = run_llm(cfg)
    return res


def _first_difference(a, b):
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _chosen_moves(ref, other):
    """|lp_ref - lp_other| of ref's chosen token at every position where the
    two runs' texts still agree (the logprobs' keys are token ids as text)."""
    moves = []
    for a, b in zip(ref["outputs"], other["outputs"]):
        i = _first_difference(a["token_ids"], b["token_ids"])
        for j in range(i):
            t = str(a["token_ids"][j])
            moves.append(abs(a["logprobs"][j][t] - b["logprobs"][j][t]))
    return moves


def check_equal_up_to_near_ties(plain, spec):
    """The module docstring's near-tie rule; returns (diverged prompts: their
    index and first differing output position, the moves where the runs
    agree)."""
    moves = _chosen_moves(plain, spec)
    assert moves, "no position where the runs agree"
    eps = max(moves)
    diverged = []
    for n, (a, b) in enumerate(zip(plain["outputs"], spec["outputs"])):
        ta, tb = a["token_ids"], b["token_ids"]
        assert len(ta) == len(tb)
        i = _first_difference(ta, tb)
        if i == len(ta):
            continue
        x, y = str(ta[i]), str(tb[i])
        lp, ls = a["logprobs"][i], b["logprobs"][i]
        # each run's choice is in the other's top TOP, or it is no near-tie
        assert y in lp and x in ls, (n, i, lp, ls)
        move = (lp[x] - lp[y]) + (ls[y] - ls[x])
        print(f"prompt {n}: texts part at output token {i}: plain {x} by {lp[x] - lp[y]:.4f}, "
              f"speculation {y} by {ls[y] - ls[x]:.4f}; move {move:.4f}, "
              f"largest move where they agree {eps:.4f}")
        assert move <= 2 * eps, (n, i, move, eps)
        diverged.append((n, i))
    return diverged, moves


def _read_log(prefix):
    """(records: [bytes of one final tile, all layers], stats) of a run: the
    last record logged for each block. The prompts' tiles fit in the budget
    at once, so no block is handed out twice; a block logged more than once
    is one vLLM's dummy steps (seen after start-up under async scheduling)
    committed before the request that got it, whose record comes last."""
    records, stats = {}, None
    files = [f for f in glob.glob(prefix + ".*") if not f.endswith((".bin", ".go"))]
    assert files, f"no commit log written at {prefix}.*"
    for f in files:
        data = open(f + ".bin", "rb").read()
        for line in open(f):
            kind, rest = line.split(" ", 1)
            if kind == "record":
                _, block, off, n = rest.split()
                records[int(block)] = data[int(off):int(off) + int(n)]
            else:
                stats = json.loads(rest)
    return list(records.values()), stats


def _decoded_keys(fmt_name, head_dim, n_kv_heads, raw):
    """Decoded keys of one tile's records over every layer and KV head:
    fp32 [G, layers * Hk * D], a row per token (rotated basis)."""
    import ctypes
    import numpy as np
    from kvarn_vllm import _lib
    L = _lib.lib()
    L.kvarn_decode.restype = ctypes.c_int
    L.kvarn_decode.argtypes = [ctypes.POINTER(_lib.Format), ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    fmt = _lib.parse_format(fmt_name, head_dim)
    rb = _lib.record_bytes(fmt, head_dim)
    n = len(raw) // rb
    assert n * rb == len(raw) and n % n_kv_heads == 0
    buf = ctypes.create_string_buffer(raw, len(raw))
    out = np.zeros((n, fmt.tile_tokens, head_dim), dtype=np.float32)
    for i in range(n):
        _lib.check(L.kvarn_decode(ctypes.byref(fmt), head_dim, ctypes.addressof(buf) + i * rb,
                                  rb, out[i].ctypes.data, None, 1), "decode")
    return out.transpose(1, 0, 2).reshape(fmt.tile_tokens, -1)


@pytest.fixture(scope="module")
def k4v2_pair(tmp_path_factory, hf_model):
    d = tmp_path_factory.mktemp("spec")
    plain = _run("kvarn_k4v2_g128", False, str(d / "plain"))
    spec = _run("kvarn_k4v2_g128", True, str(d / "spec"))
    return plain, spec, _read_log(str(d / "plain")), _read_log(str(d / "spec"))


def test_spec_decode_runs_and_equals_plain_decode(k4v2_pair):
    """Equal up to near-ties, and speculation moves the log-probabilities
    less than the codec does (module docstring)."""
    plain, spec, _, _ = k4v2_pair
    _, moves = check_equal_up_to_near_ties(plain, spec)
    exact = _run("auto", False)
    codec = _chosen_moves(exact, plain)
    mean_spec, mean_codec = sum(moves) / len(moves), sum(codec) / len(codec)
    print(f"mean |lp| move: speculation vs plain {mean_spec:.5f} ({len(moves)} positions), "
          f"kvarn_k4v2_g128 vs fp32 cache {mean_codec:.5f} ({len(codec)})")
    assert mean_spec < mean_codec
    m = spec["metrics"]
    assert m.get("vllm:spec_decode_num_draft_tokens", 0) > 0
    assert 0 < m.get("vllm:spec_decode_num_accepted_tokens", 0) < \
        m["vllm:spec_decode_num_draft_tokens"]


def test_rejected_drafts_never_reach_a_committed_record(k4v2_pair):
    """Every final record of the speculative run holds, token by token, the
    keys of the plain run's record for the same tile (check_records_match)."""
    plain_run, spec_run, (rec_plain, st_plain), (rec_spec, st_spec) = k4v2_pair
    # the speculative run met every case: tiles encoded from drafts, some
    # written again after a rejection, the others confirmed once accepted
    assert st_spec["provisional"] > 0 and st_spec["refilled"] > 0 and st_spec["confirmed"] > 0
    assert st_plain == {"provisional": 0, "refilled": 0, "confirmed": 0}
    check_records_match(plain_run, spec_run, rec_plain, rec_spec,
                        NGRAM["num_speculative_tokens"])


def check_records_match(plain_run, spec_run, rec_plain, rec_spec, drafts, prompts=None,
                        fmt="kvarn_k4v2_g128", head_dim=64, n_kv_heads=3, n_layers=30):
    """The final records of a speculative run (drafts: its tokens proposed a
    step) against a plain run's of the same prompts (prompt_ids() unless
    given), SmolLM2's shapes by default. Each record is n_layers layers of
    n_kv_heads tile records (no proposer layer among them). Not byte for
    byte: a verification step computes K/V in a batch of 1 + k rows where
    plain decoding has one, and the model's fp32 arithmetic then differs in
    the last bits, which moves a rounding now and then (tiles filled within
    a prefill are the same bytes). So rows are compared: a row of the right
    token is within the codec's step of the plain run's row, while a
    rejected draft is another token, as far from it as two neighbouring
    tokens of the same tile are from each other."""
    import numpy as np
    from kvarn_vllm import _lib
    rb = _lib.record_bytes(_lib.parse_format(fmt, head_dim), head_dim)
    assert {len(r) for r in rec_plain + rec_spec} == {n_layers * n_kv_heads * rb}
    prompts = prompts or prompt_ids()
    assert len(rec_plain) >= len(prompts)
    # a request that ends right after drafts filled a tile leaves it
    # provisional for good, and drafts accepted past max_tokens may complete
    # one more: at most one tile per request either way
    assert abs(len(rec_spec) - len(rec_plain)) <= len(prompts)
    # Where a near-tie parted the texts (check_equal_up_to_near_ties), the
    # tiles from that position on hold other tokens in the two runs: each
    # such request has at most (its length + drafts) // G - (position // G)
    # of them, and they are left out (the worst-matching ones).
    diverged, _ = check_equal_up_to_near_ties(plain_run, spec_run)
    parted = sum((len(prompts[n]) + len(plain_run["outputs"][n]["token_ids"]) + drafts) // G -
                 (len(prompts[n]) + i) // G for n, i in diverged)
    plain = [_decoded_keys(fmt, head_dim, n_kv_heads, r) for r in rec_plain]
    rows = []
    for r in rec_spec:
        k = _decoded_keys(fmt, head_dim, n_kv_heads, r)
        # the plain tile it is (the nearest)
        dist = [np.linalg.norm(k - p) for p in plain]
        p = plain[int(np.argmin(dist))]
        norm = np.linalg.norm(p, axis=1)
        rows.append((float((np.linalg.norm(k - p, axis=1) / norm).max()),
                     float(np.median(np.linalg.norm(p[1:] - p[:-1], axis=1) / norm[1:]))))
    rows.sort()
    kept = rows[:len(rows) - parted] if parted else rows
    assert len(kept) >= len(rows) // 2, (len(rows), parted)
    worst, gap = max(w for w, _ in kept), min(g for _, g in kept)
    print(f"spec vs plain records: {len(kept)} of {len(rows)} tiles compared ({parted} where "
          f"the texts parted left out); worst row {worst:.4f} of its norm; neighbouring tokens "
          f"{gap:.3f} and more (median per tile); "
          f"{sum(a == b for a in rec_spec for b in rec_plain)} of {len(rec_spec)} tiles identical")
    assert worst < 0.25 * gap


@pytest.mark.parametrize("fmt", ["kvarn_k4v2_g64", "kvarn_k4v4_g128", "kvarn_k4v4_g64"])
def test_spec_decode_equals_plain_decode_every_preset(fmt, hf_model):
    block = int(fmt.rsplit("_g", 1)[1])
    plain = _run(fmt, False, max_tokens=32, block=block)
    spec = _run(fmt, True, max_tokens=32, block=block)
    check_equal_up_to_near_ties(plain, spec)
    assert spec["metrics"].get("vllm:spec_decode_num_accepted_tokens", 0) > 0
