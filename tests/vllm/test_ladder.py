"""kvarn-vllm-ladder (python -m kvarn_vllm.ladder): the same numbers as
`kvarn eval` where the protocols meet, vLLM's own capacity arithmetic, and
the errors it gives before any engine starts. Each ladder run forks one
engine per format; the runs here are kept to a few engines of a 640-token
window (SmolLM2) or a 400-token prompt (random-weight Qwen2). The command
runs with PYTHONPATH=python/ (this checkout's plug-in); the tests that
call its functions in-process import the installed one (scripts/setup.sh
installs python/ editable)."""
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import GGUF_MODEL, KVARN_CLI, ROOT, staging_pool_bytes

KV = "kvarn_k4v2_g128"
CTX, DECODED = 640, 256          # test_serve's window: 384 prompt positions, 256 decoded
AUSTEN = os.path.join(ROOT, "data", "austen", "persuasion.txt")
LAYERS, HK, D = 30, 3, 64        # SmolLM2-135M
RECORD = 7296                    # kvarn_k4v2_g128 tile record, D = 64 (spec worked sizes)
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    [os.path.join(ROOT, "python")] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


def _ladder(*args, timeout=900):
    """The ladder of this checkout (PYTHONPATH=python/), as a command."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "kvarn_vllm.ladder", *map(str, args)],
                       capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=timeout)
    return r, time.perf_counter() - t0


def _text(tmp_path_factory):
    f = tmp_path_factory.mktemp("ladder_text") / "t.txt"
    with open(AUSTEN, encoding="utf-8") as src:
        f.write_text(src.read()[:4000])     # test_serve's eval_c text: > 640 tokens
    return f


@pytest.fixture(scope="module")
def runs(hf_model, tmp_path_factory):
    """The ladder (auto, kvarn_k4v2_g128; budget 1 GiB, max_num_seqs 8) and
    `kvarn eval --json` (int8 staging, the plug-in's default on CPU) on the
    same 640-token window."""
    text = _text(tmp_path_factory)
    out = tmp_path_factory.mktemp("ladder")
    r, secs = _ladder("--model", hf_model, "--text", text, "--kv-cache-dtype", f"auto,{KV}",
                      "--ctx", CTX, "--windows", 1, "--decode", DECODED, "--budget", "1GiB",
                      "--max-num-seqs", 8, "--json", out / "r.json")
    assert r.returncode == 0, r.stderr[-4000:]
    print(f"ladder: {secs:.0f} s\n{r.stdout}")
    rep = json.loads((out / "r.json").read_text())
    e = subprocess.run([KVARN_CLI, "eval", "-m", GGUF_MODEL, "-f", str(text), "--ctx", str(CTX),
                        "--chunk", "128", "--windows", "1", "--decode-tokens", str(DECODED),
                        "--kv-cache-dtype", KV, "--json", "--kvarn-staging", "int8"],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert e.returncode == 0, e.stderr
    return rep, r, json.loads(e.stdout)


def _row(rep, label):
    return next(f for f in rep["formats"] if f["label"] == label)


def test_positions_are_kvarn_evals(runs):
    """The same window cut the same way: kvarn eval's chunk-fed positions
    are the ladder's prompt positions, its decoded ones (less the last,
    which has no next token) the ladder's decode positions."""
    rep, _, ev = runs
    row, e = _row(rep, KV), ev["formats"][0]
    assert rep["text_tokens"] >= CTX and rep["ctx"] == CTX and rep["windows"] == 1
    assert row["positions"] == CTX - 1 == e["positions"]
    assert row["decode_positions"] == DECODED - 1 == e["decode_positions"]
    assert row["prompt_positions"] == e["chunk_positions"] == CTX - DECODED
    # where the format's top 100 lacks a reference top-20 token the fold is
    # looser: few such positions (the lower bound below relies on most of
    # them holding all 20)
    assert row["decode_kld_partial"] <= (DECODED - 1) // 4


def test_decode_kld_matches_kvarn_eval(runs):
    """Over the decoded positions both tools run one codec on the same
    tokens, each query reading earlier tiles as records and its own tile
    staged (docs/eval.md "Through vLLM"), so the ladder's decode KLD must be
    within the C host's own effect of kvarn eval's (|K_v - K_c| <= K_c).
    vLLM returns top-k log-probs only and the ladder folds the rest of the
    vocabulary into one bucket, which can only lower KL: checked
    K_v <= 2 K_c and K_v >= K_c / 4 (test_serve's
    test_kld_matches_kvarn_eval_decode, same window and protocol)."""
    rep, _, ev = runs
    k_v, k_c = _row(rep, KV)["decode_kld_mean"], ev["formats"][0]["decode_kld_mean"]
    print(f"decode KLD mean: ladder (vLLM, folded top 20) {k_v:.5f}, kvarn eval {k_c:.5f}")
    assert rep["kld_mode"].startswith("folded")
    assert k_c / 4 <= k_v <= 2 * k_c


def test_bytes_per_token_are_kvarn_evals(runs):
    """Bytes per token from vLLM's pages: kvarn_k4v2_g128's equal kvarn
    eval's (one record of RECORD bytes per 128 tokens, layer and KV head);
    the reference (the fp32 model's auto cache) is 2 x eval's fp16 one."""
    rep, _, ev = runs
    assert _row(rep, KV)["bytes_per_token"] == ev["formats"][0]["bytes_per_token"] \
        == LAYERS * HK * RECORD / 128
    assert rep["model_dtype"] == "float32"
    assert _row(rep, "auto")["bytes_per_token"] == LAYERS * HK * 2 * D * 4


def test_capacity_is_vllms_arithmetic(runs):
    """--budget 1GiB --max-num-seqs 8: the KV tokens are those of the
    arithmetic test_serve checks against a running engine (budget less the
    staging pool of 8 sequences and the shared scratch, in record pages of
    128 tokens; the fp32 cache in pages of its block size), the requests
    that fit are those blocks less vLLM's null block over 640 tokens'
    blocks, at most 8, and the measuring engine's own blocks are what the
    same computation predicts (no warning)."""
    rep, r, _ = runs
    row, ref = _row(rep, KV), _row(rep, "auto")
    batched = rep["max_num_batched_tokens"]
    pool = staging_pool_bytes(LAYERS, HK, D, 8, batched=batched)
    blocks = (2**30 - pool) // (LAYERS * HK * RECORD)
    assert row["pool_bytes"] == pool
    assert row["kv_tokens"] == blocks * 128
    assert row["requests_fit"] == min(8, (blocks - 1) // 5)
    bs = ref["block_size"]
    ref_blocks = 2**30 // (LAYERS * HK * 2 * D * 4 * bs)
    assert ref["kv_tokens"] == ref_blocks * bs
    assert ref["requests_fit"] == min(8, (ref_blocks - 1) // -(-CTX // bs))
    assert row["x_ref"] == pytest.approx(row["kv_tokens"] / ref["kv_tokens"])
    assert rep["warnings"] == [], rep["warnings"]
    assert "not vLLM's" not in r.stderr


def test_table_names_the_reference_and_the_fold(runs):
    _, r, _ = runs
    assert "reference: auto, vLLM's unquantized cache (float32)" in r.stdout
    assert "folded" in r.stdout and "lower bound" in r.stdout
    assert KV in r.stdout


@pytest.mark.parametrize("dtypes,needle", [
    ("kvarn_k4v3_g128", "accepted"),                          # the C library's explanation
    ("int8", "per-token format of the kvarn library"),
    ("fp6", "unknown --kv-cache-dtype 'fp6'"),
    (f"{KV}:KVARN_STAGING=fp6", "KVARN_STAGING must be one of"),
])
def test_bad_format_fails_before_any_engine(hf_model, tmp_path_factory, dtypes, needle):
    r, secs = _ladder("--model", hf_model, "--text", AUSTEN, "--kv-cache-dtype", dtypes,
                      timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert needle in r.stderr, r.stderr[-2000:]
    assert "starting the engine" not in r.stderr


@pytest.mark.parametrize("model,needle", [
    (os.path.join(ROOT, "models", "no-such-model"), "no config.json there"),
    (GGUF_MODEL, "kvarn_vllm.convert_gguf"),
])
def test_bad_model_fails_at_start(model, needle):
    r, _ = _ladder("--model", model, "--text", AUSTEN, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert needle in r.stderr, r.stderr[-2000:]
    assert "starting the engine" not in r.stderr


def test_plot_or_its_error(hf_model, tmp_path):
    """--plot: where matplotlib is missing, an error telling how to install
    it before anything runs; where it is there, a PNG from the report
    (plot() on the test's own report: one engine run is enough)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        r, _ = _ladder("--model", hf_model, "--text", AUSTEN, "--kv-cache-dtype", KV,
                       "--plot", tmp_path / "p.png", timeout=120)
        assert r.returncode == 2 and "pip install matplotlib" in r.stderr, r.stderr[-2000:]
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from kvarn_vllm.ladder import pareto, plot
    rep = dict(formats=[dict(label=n, status="ok", x_ref=c, decode_kld_mean=k)
                        for n, c, k in (("a", 1.0, 0.01), ("b", 2.0, 0.02), ("c", 1.5, 0.03))],
               budget_bytes=2**30, decode=256, kld_mode="exact", model="m", windows=1,
               ctx=640, vllm_version="0.32.0")
    assert pareto([(1.0, 0.01), (2.0, 0.02), (1.5, 0.03)]) == [0, 1]
    plot(rep, str(tmp_path / "p.png"), plt)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- random-weight models of other families (make_models.py): exact KLD
# (a vocabulary of 2048: every entry asked for), token ids instead of a text

G = 128
FAM_LEN = 3 * G + 16             # test_families' prompt: 3 full tiles and 16 tokens
READ_FROM = 2 * G                # first position whose query reads a record (sink 1 tile)


def _fam_ids(n: int) -> list:
    import numpy as np
    sys.path.insert(0, os.path.dirname(__file__))
    import make_models
    return [int(x) for x in np.random.default_rng(1).integers(3, make_models.VOCAB, n)]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    sys.path.insert(0, os.path.dirname(__file__))
    import make_models
    out = str(tmp_path_factory.mktemp("ladder_families"))
    ids = tmp_path_factory.mktemp("ladder_ids") / "ids.json"
    ids.write_text(json.dumps(_fam_ids(FAM_LEN)))
    return {f: make_models.make(f, out) for f in ("qwen2", "phi3")}, ids


def test_qwen2_decode_kld_matches_emulation(families, tmp_path):
    """Qwen2 (value biases, head_dim 128): the ladder's decode columns over
    the positions whose queries read a record ([2G, FAM_LEN - 1), --decode
    FAM_LEN - 2G) against the codec's effect on the same K/V computed
    without vLLM (emulate.py: transformers fp32, libkvarn's encode/decode,
    the plug-in's read rule, int8 staging), K_e: one codec on two hosts, so
    K_e / 2 <= K_v <= 2 K_e (test_families' rule). KLD is exact here."""
    import emulate
    models, ids = families
    r, secs = _ladder("--model", models["qwen2"], "--token-ids", ids, "--kv-cache-dtype",
                      f"auto,{KV}", "--ctx", FAM_LEN, "--windows", 1, "--decode",
                      FAM_LEN - READ_FROM, "--budget", "256MiB", "--json", tmp_path / "r.json")
    assert r.returncode == 0, r.stderr[-4000:]
    print(f"ladder: {secs:.0f} s\n{r.stdout}")
    rep = json.loads((tmp_path / "r.json").read_text())
    row = _row(rep, KV)
    assert rep["kld_mode"] == "exact" and rep["vocab"] == 2048
    assert row["decode_positions"] == FAM_LEN - READ_FROM - 1
    assert row["decode_kld_partial"] == 0
    # its prompt positions [0, 2G) read no record: said before the run
    assert [w for w in rep["warnings"] if "prompt columns of kvarn_k4v2_g128" in w], rep
    assert "prompt columns of kvarn_k4v2_g128" in r.stderr
    # capacity without --max-num-seqs: the largest N whose staging pool
    # (N sequences, the docs/vllm.md arithmetic) leaves blocks for N
    # requests of FAM_LEN tokens (4 blocks each, one null block held back),
    # and N + 1 does not fit
    layers, hk, d = 3, 1, 128                          # make_models' qwen2
    block = layers * hk * round(row["bytes_per_token"] * G / (layers * hk))
    budget = 256 * 2**20

    def fits(n):
        pool = staging_pool_bytes(layers, hk, d, n, batched=rep["max_num_batched_tokens"])
        return ((budget - pool) // block - 1) // 4
    n = row["max_num_seqs"]
    assert row["requests_fit"] == n and fits(n) >= n and fits(n + 1) < n + 1, (n, fits(n))
    assert row["kv_tokens"] == (budget - row["pool_bytes"]) // block * G
    assert row["pool_bytes"] == staging_pool_bytes(layers, hk, d, n,
                                                   batched=rep["max_num_batched_tokens"])
    prompt = json.loads(ids.read_text())
    exact = emulate.logprobs(models["qwen2"], prompt, quantize=False)
    codec = emulate.logprobs(models["qwen2"], prompt, quantize=True, staging="int8")
    k_e = float(emulate.kl_rows(exact, codec)[READ_FROM:FAM_LEN - 1].mean())
    k_v = row["decode_kld_mean"]
    print(f"qwen2 decode KLD: ladder {k_v:.5f}, emulated codec {k_e:.5f}")
    assert k_e / 2 <= k_v <= 2 * k_e


def test_model_the_plugin_cannot_serve(families, tmp_path):
    """Phi-3 (head_dim 96): vLLM's own cache runs, the kvarn format is a
    refused row with the plug-in's reason and what to do, and the exit
    status is 1 (it was named)."""
    models, ids = families
    r, _ = _ladder("--model", models["phi3"], "--token-ids", ids, "--kv-cache-dtype",
                   f"auto,{KV}", "--ctx", 64, "--windows", 1, "--decode", 16,
                   "--budget", "256MiB", "--json", tmp_path / "r.json")
    assert r.returncode == 1, r.stderr[-3000:]
    rep = json.loads((tmp_path / "r.json").read_text())
    row = _row(rep, KV)
    assert row["status"] == "refused"
    for needle in ("head_dim 96", "64, 128, 256 or 512", "--kv-cache-dtype auto"):
        assert needle in row["reason"], row["reason"]
    assert _row(rep, "auto")["status"] == "reference"
    assert "refused on this build" in r.stdout and "head_dim 96" in r.stdout
    # the ladder keeps vLLM's output of a refused engine and names it
    assert os.path.dirname(row["log"]) in r.stderr
    import shutil
    shutil.rmtree(os.path.dirname(row["log"]), ignore_errors=True)


# ---- no engine: the scoring and the format list


def _window(lp, k):
    """A window's record as the engine's process returns it, from full
    log-probabilities lp [n, V] (float64) and the next tokens: the top k
    ids and log-probs by rank, and the next token's log-prob."""
    import numpy as np
    order = np.argsort(-lp, axis=1)[:, :k]
    nxt = np.arange(len(lp)) % lp.shape[1]
    return dict(top_ids=order.astype(np.int32),
                top_lps=np.take_along_axis(lp, order, 1).astype(np.float32),
                actual_lp=lp[np.arange(len(lp)), nxt].astype(np.float32))


def test_score_exact_and_folded_lower_bound():
    """score() on random distributions (V = 300, 64 positions, 16 of them
    decode): with every entry (exact mode) the KLD is sum p (log p - log q)
    computed here independently; folded over the reference's top 20 against
    the format's top 100 it is never above the exact figure at any
    statistic's position set (merging outcomes lowers KL), and positive."""
    import numpy as np
    from kvarn_vllm.ladder import score
    rng = np.random.default_rng(0)
    n, V, dec = 64, 300, 16
    zp = rng.normal(0, 3, (n, V))
    zq = zp + rng.normal(0, 0.3, (n, V))
    lp = zp - np.log(np.exp(zp).sum(1, keepdims=True))
    lq = zq - np.log(np.exp(zq).sum(1, keepdims=True))
    kl = (np.exp(lp) * (lp - lq)).sum(1)
    ex = score({"windows": [_window(lp, V)]}, {"windows": [_window(lq, V)]}, n + 1, dec, True)
    assert ex["kld_mean"] == pytest.approx(kl[:n - dec + 1].mean(), rel=1e-4)
    assert ex["decode_kld_mean"] == pytest.approx(kl[n - dec + 1:].mean(), rel=1e-4)
    assert ex["prompt_positions"] == n - dec + 1 and ex["decode_positions"] == dec - 1
    top1 = (lp.argmax(1) == lq.argmax(1))
    assert ex["top1"] == pytest.approx(top1[:n - dec + 1].mean())
    fo = score({"windows": [_window(lp, 100)]}, {"windows": [_window(lq, 100)]}, n + 1, dec,
               False)
    for key in ("kld_mean", "decode_kld_mean", "kld_median", "kld_max"):
        assert 0 < fo[key] <= ex[key] * (1 + 1e-5), key
    assert fo["top1"] == ex["top1"] and fo["ppl"] == pytest.approx(ex["ppl"])


def test_all_lists_what_this_build_refuses():
    """`all`: the reference first; vLLM's fp8 caches, the four presets and
    their mean-centred variants, and the default preset with each other
    staging run; the per-token kvarn names are refused rows, each with its
    reason."""
    from kvarn_vllm import ladder
    jobs, refused = ladder.expand_formats("all", ladder._vllm_cache_dtypes())
    labels = [j.label for j in jobs]
    assert labels[0] == "auto" and not any(j.explicit for j in jobs)
    for name in ("fp8_e4m3", "fp8_e5m2", "kvarn_k4v2_g64", "kvarn_k4v4_g64",
                 f"{KV}:KVARN_STAGING=int4", f"{KV}c", "kvarn_k4v4_g64c"):
        assert name in labels
    why = dict(refused)
    assert "per-token format of the kvarn library" in why["int8"]


def test_coverage_warnings():
    """The columns that read no quantized tile (the first position reading
    a record is 2G = 256 with the default one-tile sink, G = 128 with a
    16-token sink, and vLLM's own formats quantize everything): named with
    the --ctx that measures them, which then warns no more."""
    from kvarn_vllm.ladder import Job, coverage_warnings
    jobs = [Job("auto", "auto", {}, True), Job(KV, KV, {}, True)]
    assert coverage_warnings(jobs, CTX, DECODED) == []
    w = coverage_warnings(jobs, FAM_LEN, FAM_LEN - READ_FROM)   # prompt positions [0, 256)
    assert len(w) == 1 and "prompt columns of kvarn_k4v2_g128" in w[0] and "--ctx 401" in w[0]
    assert coverage_warnings(jobs, 401, FAM_LEN - READ_FROM) == []
    s16 = [Job(f"{KV}:KVARN_SINK_TOKENS=16", KV, {"KVARN_SINK_TOKENS": "16"}, True)]
    assert coverage_warnings(s16, FAM_LEN, FAM_LEN - READ_FROM) == []
    w = coverage_warnings(jobs, 200, 50)            # every position below 256
    assert len(w) == 2 and "--ctx 258" in w[1] and "decode columns" in w[1]
    assert coverage_warnings(jobs, 258, 50)[1:] == []
