"""kvarn-vllm-ladder (python -m kvarn_vllm.ladder): the same numbers as
`kvarn eval` where the protocols meet, vLLM's own capacity arithmetic, and
the errors it gives before any engine starts; every model family the
plug-in serves (or refuses) through it, on its random-weight model
(make_models.py) against the arithmetic and the emulated codec; the
value-bias lines, the console script, the plot's labels; an MLA model
(DeepSeek-V3's attention shape) through `all`, its kvarn_mla_* rows
against the record arithmetic and the emulated codec (emulate_mla.py),
its decode columns decoded with the text's tokens forced, and every name
refused there or on SmolLM2 in one line. Each ladder run forks
one engine per format; the runs here are kept to a few engines of a
640-token window (SmolLM2) or a 400-token prompt (the random-weight
models: one run per family, through ladder_serve.py, which imports vLLM
once for all of them; the MLA model: one run of 7 engines on a 296-token
window, 32 tokens decoded). The command runs with PYTHONPATH=python/ (this
checkout's plug-in); the tests that
call its functions in-process import the installed one (scripts/setup.sh
installs python/ editable)."""
import json
import os
import subprocess
import sys
import time

import pytest

import forkserver
from conftest import GGUF_MODEL, KVARN_CLI, ROOT, staging_pool_bytes

KV = "kvarn_k4v2_g128"
PER_TOKEN = "kvarn_int8"                   # a per-token format: kvarn eval's int8
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
    """The ladder (auto, kvarn_k4v2_g128, the per-token kvarn_int8; budget
    1 GiB, max_num_seqs 8) and `kvarn eval --json` (int8 staging, the
    plug-in's default on CPU) on the same 640-token window."""
    text = _text(tmp_path_factory)
    out = tmp_path_factory.mktemp("ladder")
    r, secs = _ladder("--model", hf_model, "--text", text, "--kv-cache-dtype",
                      f"auto,{KV},{PER_TOKEN}",
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


def test_per_token_row(runs):
    """kvarn_int8 through the ladder: its bytes per token are kvarn eval's
    int8 records (2D + 8 bytes per token, layer and KV head: D codes and an
    fp16 scale and zero-point for K and for V), its KV tokens the budget in
    pages of vLLM's block size with no staging pool, and its decode KLD
    above zero and below kvarn_k4v2_g128's (8-bit codes against 4/2-bit)."""
    rep, _, _ = runs
    row, kv = _row(rep, PER_TOKEN), _row(rep, KV)
    per_tok = LAYERS * HK * (2 * D + 8)
    assert row["status"] == "ok" and row["pool_bytes"] == 0
    assert row["bytes_per_token"] == per_tok
    bs = row["block_size"]
    assert bs % 16 == 0
    assert row["kv_tokens"] == 2**30 // (per_tok * bs) * bs
    assert 0 < row["decode_kld_mean"] < kv["decode_kld_mean"] / 4, (row, kv)


def test_plot_shows_the_per_token_row(runs):
    """--plot's figure of the run above: a point and a label for each
    measured row, the per-token kvarn_int8 one beside kvarn_k4v2_g128, at
    its capacity and decode KLD (the reference is the axes' origin, not a
    point)."""
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from kvarn_vllm.ladder import figure
    rep, _, _ = runs
    fig = figure(rep, plt)
    try:
        texts = {t.get_text(): t.xy for t in fig.axes[0].texts}
        assert sorted(texts) == sorted([KV, PER_TOKEN]), texts
        row = _row(rep, PER_TOKEN)
        assert texts[PER_TOKEN] == pytest.approx((row["x_ref"], row["decode_kld_mean"]))
    finally:
        plt.close(fig)


def test_table_names_the_reference_and_the_fold(runs):
    _, r, _ = runs
    assert "reference: auto, vLLM's unquantized cache (float32)" in r.stdout
    assert "folded" in r.stdout and "lower bound" in r.stdout
    assert KV in r.stdout


@pytest.mark.parametrize("dtypes,needle", [
    ("kvarn_k4v3_g128", "accepted"),                          # the C library's explanation
    ("int8", "through vLLM it is kvarn_int8"),
    ("kvarn_int8:KVARN_STAGING=fp16", "does not apply"),
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


# the README run's capacities and decode KLDs (docs/eval.md), formats close
# to each other, and five formats at one point: labels that would overlap
# beside their points
CLOSE = [("bfloat16", 2.00, 0.44856), ("fp8_e4m3", 4.00, 0.03142), ("fp8_e5m2", 4.00, 0.14646),
         (KV, 6.92, 0.00962), ("kvarn_k4v2_g64", 7.48, 0.01280),
         ("kvarn_k4v4_g128", 5.69, 0.00199), ("kvarn_k4v4_g64", 6.06, 0.00292),
         (f"{KV}:KVARN_STAGING=fp16", 5.75, 0.00986),
         (f"{KV}:KVARN_STAGING=fp8_e4m3", 6.97, 0.01484),
         (f"{KV}:KVARN_STAGING=int4", 7.76, 0.06417), (f"{KV}c", 6.83, 0.01170),
         ("kvarn_k4v2_g64c", 7.26, 0.01152), ("kvarn_k4v4_g128c", 5.63, 0.00209),
         ("kvarn_k4v4_g64c", 5.92, 0.00238)] + \
    [(f"same_point_{i}", 3.0, 0.05) for i in range(5)]


def _png_size(data: bytes) -> tuple:
    """(width, height) from a PNG's IHDR chunk."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_plot_or_its_error(hf_model, tmp_path):
    """--plot: where matplotlib is missing, an error telling how to install
    it before anything runs; where it is there, a PNG from the report
    (plot() on the test's own report: one engine run is enough) whose
    labels do not overlap: each point's label read back from the figure
    (its text's box in the PNG's pixels, figure() at the dpi plot() writes)
    meets no other label's box and lies inside the image."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        r, _ = _ladder("--model", hf_model, "--text", AUSTEN, "--kv-cache-dtype", KV,
                       "--plot", tmp_path / "p.png", timeout=120)
        assert r.returncode == 2 and "pip install matplotlib" in r.stderr, r.stderr[-2000:]
        return
    import itertools
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text
    from kvarn_vllm.ladder import PLOT_DPI, figure, pareto, plot
    assert pareto([(1.0, 0.01), (2.0, 0.02), (1.5, 0.03)]) == [0, 1]
    rep = dict(formats=[dict(label=n, status="ok", x_ref=c, decode_kld_mean=k)
                        for n, c, k in CLOSE] + [dict(label="auto", status="reference",
                                                      x_ref=1.0, decode_kld_mean=None)],
               budget_bytes=16 * 2**30, decode=256, kld_mode="folded", model="m", windows=4,
               ctx=2048, vllm_version="0.32.0")
    png = tmp_path / "p.png"
    plot(rep, str(png), plt)
    w, h = _png_size(png.read_bytes())
    fig = figure(rep, plt)
    try:
        assert fig.dpi == PLOT_DPI
        fig.savefig(tmp_path / "q.png", dpi=PLOT_DPI)
        assert (tmp_path / "q.png").read_bytes() == png.read_bytes()
        rend = fig.canvas.get_renderer()
        texts = fig.axes[0].texts
        assert sorted(t.get_text() for t in texts) == sorted(n for n, _, _ in CLOSE)
        boxes = {t.get_text(): Text.get_window_extent(t, rend) for t in texts}
        for (a, ba), (b, bb) in itertools.combinations(boxes.items(), 2):
            assert not ba.overlaps(bb), (a, ba, b, bb)
        for a, ba in boxes.items():
            assert 0 <= ba.x0 and ba.x1 <= w and 0 <= ba.y0 and ba.y1 <= h, (a, ba, w, h)
    finally:
        plt.close(fig)


# ---- random-weight models of the families (make_models.py): exact KLD (a
# vocabulary of 2048: every entry asked for), token ids instead of a text;
# one ladder run per family, its formats: auto, kvarn_k4v2_g128, where the
# family has a setting to compare the variant, and the per-token kvarn_int4
# (the plug-in's per-token formats share one path; int4 moves the KLD most)

G = 128
FAM_LEN = 3 * G + 16             # test_families' prompt: 3 full tiles and 16 tokens
READ_FROM = 2 * G                # first position whose query reads a record (sink 1 tile)
FAM_BUDGET = 256 * 2**20
KVC = KV + "c"                   # values mean-centred per tile (docs/kvarn-centred.md)
QUANTIZE_SW = f"{KV}:KVARN_SLIDING_WINDOW=quantize"
PT = "kvarn_int4"
PT_QUANTIZE_SW = f"{PT}:KVARN_SLIDING_WINDOW=quantize"
FAMILY_FORMATS = {               # the served families (docs/vllm-models.md)
    "llama3": [KV, PT], "qwen2": [KV, KVC, PT], "qwen3": [KV, PT], "gemma2_nocap": [KV, PT],
    "mistral": [KV, QUANTIZE_SW, PT, PT_QUANTIZE_SW], "gpt_oss": [KV, PT], "gemma3": [KV, PT],
    "gemma4": [KV, PT]}
REFUSED = {                      # test_families' test_family_refused_at_start
    "phi3": ["head_dim 96", "64, 128, 256 or 512", "--kv-cache-dtype kvarn_int8",
             "--kv-cache-dtype auto"],
    "gemma2": ["soft-caps its attention logits", "--kv-cache-dtype auto"]}
BF16_ONLY = ("qwen3_next",)      # Gated DeltaNet layers: vLLM's CPU build runs them in bf16
SCRIPT = os.path.join(os.path.dirname(sys.executable), "kvarn-vllm-ladder")
LADDER_SERVE = os.path.join(os.path.dirname(__file__), "ladder_serve.py")


def _fam_ids(n: int) -> list:
    import numpy as np
    sys.path.insert(0, os.path.dirname(__file__))
    import make_models
    return [int(x) for x in np.random.default_rng(1).integers(3, make_models.VOCAB, n)]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family -> (its random-weight model's directory, the ladder's run:
    (CompletedProcess, report or None, seconds)), each built and run on
    first use; and the token ids' file (test_families' PROMPT)."""
    sys.path.insert(0, os.path.dirname(__file__))
    import make_models
    out = str(tmp_path_factory.mktemp("ladder_families"))
    ids = tmp_path_factory.mktemp("ladder_ids") / "ids.json"
    ids.write_text(json.dumps(_fam_ids(FAM_LEN)))
    runs = {}
    # ladder_serve.py, started on first use: the ladder's main(argv) per
    # run without each run's import of torch and vLLM
    server = forkserver.Client(LADDER_SERVE, tmp=str(tmp_path_factory.mktemp("ladder_serve")),
                               env=ENV, keep=True)

    def get(fam):
        if fam not in runs:
            model = make_models.make(fam, out)
            fmts = FAMILY_FORMATS.get(fam, [KV, PT])
            js = tmp_path_factory.mktemp("ladder_" + fam) / "r.json"
            args = ["--model", model, "--token-ids", ids, "--kv-cache-dtype",
                    ",".join(["auto"] + fmts), "--ctx", FAM_LEN, "--windows", 1, "--decode",
                    FAM_LEN - READ_FROM, "--budget", "256MiB", "--json", js]
            if fam in REFUSED and fam != "phi3":
                # every kvarn engine refuses at start-up: a short prompt (Phi-3's
                # head_dim 96 is refused by the tile formats, served by the per-token)
                args[args.index("--ctx") + 1], args[args.index("--decode") + 1] = 64, 16
            if fam in BF16_ONLY:  # vLLM's CPU build runs it in bf16 only
                args += ["--dtype", "bfloat16"]
            r, secs = _serve_ladder(server, [str(a) for a in args])
            print(f"ladder {fam}: {secs:.0f} s\n{r.stdout}")
            runs[fam] = (model, (r, json.loads(js.read_text()) if js.exists() else None, secs))
        return runs[fam]
    get.server = server
    yield get, ids
    server.close()


def _serve_ladder(server, argv: list, timeout: float = 900) -> tuple:
    """(CompletedProcess as subprocess.run gives it, seconds) of the ladder
    with argv, through the session's ladder_serve.py."""
    t0 = time.perf_counter()
    rc, out, err = server.run({"argv": argv}, timeout)
    return subprocess.CompletedProcess(argv, rc, out, err), time.perf_counter() - t0


def _shape(fam: str) -> tuple:
    """(layers, KV heads, head_dim) of make_models.FAMILIES[fam]."""
    import make_models
    kw = make_models.FAMILIES[fam][1]
    d = kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"]
    return kw["num_hidden_layers"], kw["num_key_value_heads"], d


def _record(fmt: str, d: int) -> int:
    """The bytes of one record of fmt (a tile's, or a per-token format's
    one token) for one KV head of head_dim d."""
    from kvarn_vllm import _lib
    return _lib.record_bytes(_lib.parse_format(fmt.split(":")[0], d), d)


def _page(fmt: str, hk: int, d: int) -> int:
    """A kvarn layer's page of G tokens: Hk tile records, or Hk x G
    per-token records (vLLM's default block of 128 = G on CPU, which the
    ladder keeps for the per-token formats)."""
    from kvarn_vllm import _lib
    n = G if _lib.is_per_token_dtype(fmt.split(":")[0]) else 1
    return n * hk * _record(fmt, d)


def _layers(model: str) -> list:
    """[(sliding window or None, KV heads, head_dim)] per layer, from the
    model's config.json: layer_types where the config has them (Gemma-2/3/4,
    gpt-oss, Qwen), else every layer sliding where sliding_window is set
    (Mistral); Gemma-4's per_layer_config gives its global layers' head_dim."""
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    n, per = c["num_hidden_layers"], c.get("per_layer_config") or {}
    d0 = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    types = c.get("layer_types") or (["sliding_attention" if c.get("sliding_window")
                                      else "full_attention"] * n)
    return [(c["sliding_window"] if t == "sliding_attention" else None,
             int(per.get(str(i), {}).get("num_key_value_heads", c["num_key_value_heads"])),
             int(per.get(str(i), {}).get("head_dim", d0))) for i, t in enumerate(types)]


def _expected_capacity(model: str, fmt: str, n: int, batched: int) -> tuple:
    """(KV tokens, blocks a FAM_LEN-token request holds, blocks) at
    FAM_BUDGET and max_num_seqs n, by hand from the model's layers
    (docs/vllm.md "Capacity"; docs/vllm-models.md), as vLLM 0.32's
    v1/core/kv_cache_utils.py builds the pool on this build's
    layer-outermost CPU layout (not its packed path):
      - a layer's page, blocks of G tokens (the CPU default, and the
        ladder's --block-size for kvarn): vLLM's fp32 cache Hk x 2 x D x 4
        bytes a token, a kvarn layer one record per KV head a tile, at the
        layer's own Hk and D (Gemma-4's global layer: 512). Sliding-window
        layers stay in vLLM's cache unless KVARN_SLIDING_WINDOW=quantize.
      - unify_kv_cache_spec_page_size: every page becomes the largest; a
        smaller page that divides it gets blocks that many times larger
        (kvarn beside fp32 at D >= 256, where a record's per-token share
        is a power of two). A kvarn page that does not divide vLLM's
        (gpt-oss at D = 64: 2 x 7296-byte records against a 131072-byte
        fp32 page) would be padded to it, its block unchanged, which the
        plug-in prevents (plugin.align_pages): the kvarn layers get manager
        blocks of k = ceil(fp32 page / kvarn page) tiles, and vLLM's
        sliding-window layers keep blocks of G, their pages padded to k
        kvarn pages.
      - _get_kv_cache_groups_uniform_page_size: layers grouped by spec, the
        group size the fewest layers of a kind (the most where that is
        under 1.5 x the fewest); a block is group size x the page.
      - blocks: the budget less the staging pool of n sequences (over the
        kvarn layers) over that; a request holds per group
        ceil(FAM_LEN / block) blocks, a sliding group
        ceil(min(FAM_LEN, window - 1 + batched) / block) + 1 (vLLM 0.32's
        sliding-window spec); with one group the KV tokens are blocks x
        block size, with several vLLM's own figure blocks / per request x
        FAM_LEN."""
    from collections import Counter
    layers = _layers(model)
    name, _, opt = fmt.partition(":")
    quantize_sw = opt == "KVARN_SLIDING_WINDOW=quantize"
    cdiv = lambda a, b: -(-a // b)                      # noqa: E731
    kv = [name != "auto" and (w is None or quantize_sw) for w, _, _ in layers]
    # kvarn layers of both kinds become one group of full-attention specs
    # (backend.customize_spec): gpt-oss with quantize, not derived here
    assert not (any(q and w is not None for (w, _, _), q in zip(layers, kv))
                and any(w is None for w, _, _ in layers)), "sliding and full layers in kvarn"
    pages = [_page(name, hk, d) if q else G * hk * 2 * d * 4
             for (_, hk, d), q in zip(layers, kv)]
    page = max(pages)
    blocks = [G * page // p if page % p == 0 else G for p in pages]
    own = [p for p, q in zip(pages, kv) if not q]
    mine = [p for p, q in zip(pages, kv) if q]
    if own and mine and max(own) > max(mine) and max(own) % max(mine):   # align_pages
        k = cdiv(max(own), max(mine))
        page = k * max(mine)
        blocks = [k * G if q else G for q in kv]
    kinds = Counter(zip(layers, kv))
    size = min(kinds.values())
    size = max(kinds.values()) if max(kinds.values()) < 1.5 * size else size
    shapes = [s[1:] for s, q in zip(layers, kv) if q]
    assert len(set(shapes)) <= 1       # the staging pool's one page shape
    from kvarn_vllm import _lib
    pool = staging_pool_bytes(len(shapes), *shapes[0], n, batched=batched) \
        if shapes and not _lib.is_per_token_dtype(name) else 0   # per-token: no pool
    nb = (FAM_BUDGET - pool) // (size * page)
    per_req = ngroups = 0
    for kind, count in kinds.items():
        w, b = kind[0][0], blocks[list(zip(layers, kv)).index(kind)]
        span = cdiv(min(FAM_LEN, w - 1 + batched), b) + 1 if w else cdiv(FAM_LEN, b)
        per_req += cdiv(count, size) * span
        ngroups += cdiv(count, size)
    return (nb * blocks[0] if ngroups == 1 else nb * FAM_LEN // per_req), per_req, nb


_EXACT = {}                      # model -> its exact fp32 log-probabilities (emulate.py)


def _emulated_kl(model: str, fmt: str, quantize_sliding: bool = False):
    """(K_e: the codec's KL on the same K/V without vLLM over the positions
    reading records, [READ_FROM, FAM_LEN - 1); the reference's mean NLL
    in transformers fp32 over every position), emulate.py with int8
    staging, the plug-in's CPU default; a per-token format (kvarn_int4)
    through emulate.py's TokenRecords, every token a record."""
    import emulate
    import numpy as np
    from kvarn_vllm import _lib
    ids = _fam_ids(FAM_LEN)
    if model not in _EXACT:
        _EXACT[model] = emulate.logprobs(model, ids, quantize=False)
    exact = _EXACT[model]
    if _lib.is_per_token_dtype(fmt):
        codec = emulate.logprobs(model, ids, quantize=True, quantize_sliding=quantize_sliding,
                                 per_token=_lib.PER_TOKEN_DTYPES[fmt])
    else:
        codec = emulate.logprobs(model, ids, quantize=True, quantize_sliding=quantize_sliding,
                                 staging="int8", fmt=fmt)
    k_e = float(emulate.kl_rows(exact, codec)[READ_FROM:FAM_LEN - 1].mean())
    nll = float(-np.mean(exact[np.arange(FAM_LEN - 1), ids[1:]]))
    return k_e, nll


@pytest.mark.parametrize("fam", list(FAMILY_FORMATS))
def test_family_ladder(fam, families):
    """Every family the plug-in serves, through the ladder on its
    random-weight model: the positions as asked; the KV tokens, the blocks
    a request holds and the requests that fit of every row are the
    arithmetic of _expected_capacity; the reference (vLLM's fp32 cache)
    gives the model's own NLL (transformers fp32, emulate.py) to within a
    tenth of the codec's effect (test_families' rule for its KL); each
    quantizing kvarn row's decode KLD (exact) is within [K_e / 2, 2 K_e]
    of the codec's effect K_e on the same K/V without vLLM (test_families'
    rule); Mistral's sliding-window layers, kept in vLLM's cache by
    default, give the reference's numbers exactly (nothing quantized)."""
    import math
    get, _ = families
    model, (r, rep, secs) = get(fam)
    assert r.returncode == 0, r.stderr[-4000:]
    assert rep["kld_mode"] == "exact" and rep["vocab"] == 2048 and rep["ctx"] == FAM_LEN
    assert not any("capacity not computed" in w or "not vLLM's" in w for w in rep["warnings"])
    batched = rep["max_num_batched_tokens"]
    # the codec's effect with every layer quantized where every layer is
    # sliding (Mistral: the KVARN_SLIDING_WINDOW=quantize row); elsewhere
    # the sliding layers stay in vLLM's cache, as kvarn_k4v2_g128 keeps them
    all_sliding = all(w is not None for w, _, _ in _layers(model))
    k_e0, nll = _emulated_kl(model, KV, quantize_sliding=all_sliding)
    ref = _row(rep, "auto")
    print(f"{fam}: reference ln PPL {math.log(ref['ppl']):.5f}, transformers fp32 {nll:.5f}")
    assert abs(math.log(ref["ppl"]) - nll) < k_e0 / 10
    for f in rep["formats"]:
        n = f["max_num_seqs"]
        kv_tokens, per_req, nb = _expected_capacity(model, f["label"], n, batched)
        assert (f["kv_tokens"], f["blocks_per_request"]) == (kv_tokens, per_req), f
        # without --max-num-seqs: the largest n whose pool leaves blocks for
        # n requests (vLLM's null block held back), and n + 1 does not fit
        nb1 = _expected_capacity(model, f["label"], n + 1, batched)[2]
        assert f["requests_fit"] == n and (nb - 1) // per_req >= n > (nb1 - 1) // per_req - 1, f
        if f is ref:
            continue
        assert f["status"] == "ok" and f["decode_positions"] == FAM_LEN - READ_FROM - 1
        assert f["prompt_positions"] == READ_FROM and f["decode_kld_partial"] == 0
        # its prompt positions [0, 2G) read no record: said before the run
        assert [w for w in rep["warnings"] if f"prompt columns of {KV}" in w], rep["warnings"]
        if fam == "mistral" and f["label"] in (KV, PT):   # nothing quantized: vLLM's cache
            assert f["kld_max"] == f["decode_kld_max"] == 0 and f["ppl_delta"] == 0, f
            assert f["kv_tokens"] == ref["kv_tokens"] and f["pool_bytes"] == 0
            continue
        if f["label"] in (KV, PT) and not all_sliding:
            # sliding-window and full layers (gpt-oss, Gemma-2/3/4): the
            # default keeps the sliding ones in vLLM's cache and still holds
            # more requests than vLLM's own cache (plugin.align_pages)
            assert f["x_ref"] >= 1.0 and f["requests_fit"] >= ref["requests_fit"], f
        k_e = k_e0 if f["label"] in (KV, QUANTIZE_SW) else \
            _emulated_kl(model, f["name"], quantize_sliding=f["label"] == PT_QUANTIZE_SW)[0]
        k_v = f["decode_kld_mean"]
        print(f"{fam} {f['label']}: decode KLD ladder {k_v:.5f}, emulated codec {k_e:.5f}; "
              f"KV tokens {f['kv_tokens']} (fp32 {ref['kv_tokens']}), fit {f['requests_fit']}")
        assert math.isfinite(k_v) and k_e / 2 <= k_v <= 2 * k_e
    print(f"{fam}: ladder {secs:.0f} s")


def test_sliding_windows_name_the_better_setting(families):
    """gpt-oss (2 sliding-window layers of 4) run with the default alone:
    sliding_window_notes names the same format with
    KVARN_SLIDING_WINDOW=quantize to add. With such a row beside it (the
    default's row with more KV tokens and a KLD within twice the
    default's), the line names quantize as the better setting; with a KLD
    past twice the default's, the default. Models whose layers all have a
    window (Mistral) or none (Llama-3) get no such line."""
    from kvarn_vllm.ladder import sliding_window_notes
    get, _ = families
    _, (r, rep, _) = get("gpt_oss")
    assert r.returncode == 0, r.stderr[-4000:]
    assert rep["sliding_layers"] == [2, 4]
    # one line per format run with the default: the tile format's and the
    # per-token one's
    note, pt_note = rep["sliding_window_notes"]
    assert f"{KV}:KVARN_SLIDING_WINDOW=quantize stores them as records too" in note, note
    assert f"{PT_QUANTIZE_SW} stores them as records too" in pt_note, pt_note
    assert note in r.stdout and pt_note in r.stdout
    rep = dict(rep, formats=[f for f in rep["formats"] if f["label"] != PT])
    plain = _row(rep, KV)
    q = dict(plain, label=QUANTIZE_SW, env={"KVARN_SLIDING_WINDOW": "quantize"},
             x_ref=plain["x_ref"] * 3, decode_kld_mean=plain["decode_kld_mean"] * 1.5)
    note, = sliding_window_notes(dict(rep, formats=rep["formats"] + [q]))
    assert f"better: {QUANTIZE_SW}:" in note, note
    worse = dict(q, decode_kld_mean=plain["decode_kld_mean"] * 3)
    note, = sliding_window_notes(dict(rep, formats=rep["formats"] + [worse]))
    assert f"better: {KV}: {QUANTIZE_SW} holds more but its KLD is more than twice" in note
    for fam in ("mistral", "llama3"):
        _, (_, other, _) = get(fam)
        assert other["sliding_window_notes"] == [], (fam, other["sliding_window_notes"])


def test_value_biases_name_the_better_variant(families):
    """Qwen2 (q/k/v biases, plugin.has_value_bias): the ladder ran the plain
    and the centred format, and prints which has the lower decode KLD, its
    figures and the bytes of each; on this model the centred one (as
    test_families finds on the emulated codec). Run with the plain one
    alone, value_bias_notes names the centred one to add, with its extra
    bytes per token from the C library's record sizes. A model without
    value biases (Llama-3) gets no such line."""
    from kvarn_vllm.ladder import value_bias_notes
    get, _ = families
    _, (r, rep, _) = get("qwen2")
    assert r.returncode == 0, r.stderr[-4000:]
    plain, centred = _row(rep, KV), _row(rep, KVC)
    assert rep["value_bias"] and centred["decode_kld_mean"] < plain["decode_kld_mean"]
    want = (f"the centred {KVC} wins over {KV}: decode KLD {centred['decode_kld_mean']:.5f} "
            f"against {plain['decode_kld_mean']:.5f}")
    assert rep["value_bias_notes"] and want in rep["value_bias_notes"][0], rep
    assert want in r.stdout
    _, d = _shape("qwen2")[1:]
    extra = 100 * (_record(KVC, d) - _record(KV, d)) / _record(KV, d)
    assert f"{centred['bytes_per_token']:.0f} B/token against " \
           f"{plain['bytes_per_token']:.0f} ({extra:+.1f}%)" in rep["value_bias_notes"][0]
    alone = dict(rep, formats=[f for f in rep["formats"] if f["label"] != KVC])
    note, = value_bias_notes(alone)
    assert f"its mean-centred variant {KVC}" in note and f"({extra:+.1f}% bytes" in note, note
    # and where the plain one wins, the line says so
    swapped = dict(rep, formats=[dict(f, decode_kld_mean=plain["decode_kld_mean"] * 2)
                                 if f["label"] == KVC else f for f in rep["formats"]])
    assert f"the plain {KV} wins over the centred {KVC}" in value_bias_notes(swapped)[0]
    _, (_, rep_llama, _) = get("llama3")
    assert rep_llama["value_bias"] is False and rep_llama["value_bias_notes"] == []


def test_hybrid_linear_attention_ladder(families):
    """Qwen3-Next's shape (3 Gated DeltaNet : 1 full-attention layer) through
    the ladder at --dtype bfloat16 (vLLM's CPU build runs the DeltaNet
    layers in bf16 only), its reference vLLM's own bf16 cache. kvarn's
    exact decode KLD is within [K_e / 2, 2 K_e] of the codec's effect K_e
    emulated in fp32 on the full layer (test_families' rule; vLLM's bf16 run
    is within a tenth of K_e of transformers' fp32 there,
    test_qwen3_next_hybrid_linear_attention, which also checks the blocks
    against the per-layer arithmetic). The capacity columns are vLLM's own
    figures for a hybrid (the DeltaNet state counted), so only their order
    is checked here: kvarn's smaller attention pages leave more of the
    budget to requests than the bf16 cache does."""
    import emulate
    get, _ = families
    model, (r, rep, secs) = get("qwen3_next")
    assert r.returncode == 0, r.stderr[-4000:]
    assert rep["kld_mode"] == "exact" and rep["ctx"] == FAM_LEN
    ref, kv = _row(rep, "auto"), _row(rep, KV)
    assert kv["status"] == "ok" and kv["decode_positions"] == FAM_LEN - READ_FROM - 1
    assert kv["kv_tokens"] > ref["kv_tokens"] and kv["requests_fit"] > ref["requests_fit"]
    ids = _fam_ids(FAM_LEN)
    k_e = float(emulate.kl_rows(emulate.logprobs(model, ids, quantize=False),
                                emulate.logprobs(model, ids, quantize=True, staging="int8")
                                )[READ_FROM:FAM_LEN - 1].mean())
    print(f"qwen3_next ladder ({secs:.0f} s): decode KLD {kv['decode_kld_mean']:.5f}, "
          f"emulated {k_e:.5f}; KV tokens {kv['kv_tokens']} against bf16's {ref['kv_tokens']}")
    assert k_e / 2 <= kv["decode_kld_mean"] <= 2 * k_e
    # the per-token kvarn_int4 on the full layer, by the same rule
    pt = _row(rep, PT)
    k_pt = float(emulate.kl_rows(emulate.logprobs(model, ids, quantize=False),
                                 emulate.logprobs(model, ids, quantize=True, per_token="int4")
                                 )[READ_FROM:FAM_LEN - 1].mean())
    print(f"qwen3_next {PT}: decode KLD {pt['decode_kld_mean']:.5f}, emulated {k_pt:.5f}; "
          f"KV tokens {pt['kv_tokens']}")
    assert pt["status"] == "ok" and pt["pool_bytes"] == 0
    assert pt["kv_tokens"] > ref["kv_tokens"]
    assert k_pt / 2 <= pt["decode_kld_mean"] <= 2 * k_pt


def test_per_token_serves_head_dim_96(families):
    """Phi-3 (head_dim 96, which the KVarN tile formats refuse: their
    Hadamard needs a power of two) through kvarn_int4: a row of records of
    d + 8 bytes per token and KV head, no staging pool, its KV tokens the
    page arithmetic, and its decode KLD within [K_e / 2, 2 K_e] of the
    emulated codec's (test_families' rule)."""
    get, _ = families
    model, (r, rep, _) = get("phi3")
    nl, hk, d = _shape("phi3")
    assert d == 96
    pt, ref = _row(rep, PT), _row(rep, "auto")
    assert pt["status"] == "ok" and pt["pool_bytes"] == 0, pt
    assert pt["bytes_per_token"] == nl * hk * (d + 8)
    kv_tokens, per_req, _ = _expected_capacity(model, PT, pt["max_num_seqs"],
                                               rep["max_num_batched_tokens"])
    assert (pt["kv_tokens"], pt["blocks_per_request"]) == (kv_tokens, per_req), pt
    assert pt["decode_positions"] == FAM_LEN - READ_FROM - 1
    k_e = _emulated_kl(model, PT)[0]
    print(f"phi3 {PT}: decode KLD {pt['decode_kld_mean']:.5f}, emulated {k_e:.5f}; KV tokens "
          f"{pt['kv_tokens']} (fp32 {ref['kv_tokens']})")
    assert k_e / 2 <= pt["decode_kld_mean"] <= 2 * k_e


@pytest.mark.parametrize("fam", list(REFUSED))
def test_model_the_plugin_cannot_serve(fam, families, tmp_path):
    """Phi-3 (head_dim 96), Gemma-2 with attention soft-capping: vLLM's own
    cache runs, the kvarn format is a refused row with the plug-in's reason
    and what to do (test_families' needles), and the exit status is 1 (it
    was named)."""
    get, _ = families
    _, (r, rep, _) = get(fam)
    assert r.returncode == 1, r.stderr[-3000:]
    row = _row(rep, KV)
    assert row["status"] == "refused"
    for needle in REFUSED[fam]:
        assert needle in row["reason"], row["reason"]
    if fam == "gemma2":      # soft-capping: refused for the per-token formats too
        pt = _row(rep, PT)
        assert pt["status"] == "refused" and REFUSED[fam][0] in pt["reason"], pt
    assert _row(rep, "auto")["status"] == "reference"
    assert "refused on this build" in r.stdout and REFUSED[fam][0] in r.stdout
    # the ladder keeps vLLM's output of a refused engine and names it
    assert os.path.dirname(row["log"]) in r.stderr
    import shutil
    shutil.rmtree(os.path.dirname(row["log"]), ignore_errors=True)


def test_console_script(families):
    """kvarn-vllm-ladder: declared in python/pyproject.toml as
    kvarn_vllm.ladder:main, installed with that entry point (scripts/
    setup_vllm.sh's editable install) beside this python, and it runs:
    the script's --help, and the family runs above went through the
    entry point's function (ladder_serve.py loads it; from this checkout,
    PYTHONPATH=python/)."""
    import importlib.metadata
    import tomllib
    with open(os.path.join(ROOT, "python", "pyproject.toml"), "rb") as f:
        declared = tomllib.load(f)["project"]["scripts"]
    assert declared["kvarn-vllm-ladder"] == "kvarn_vllm.ladder:main"
    eps = importlib.metadata.entry_points(group="console_scripts", name="kvarn-vllm-ladder")
    assert [e.value for e in eps] == ["kvarn_vllm.ladder:main"]
    assert os.access(SCRIPT, os.X_OK), f"{SCRIPT} missing: run scripts/setup.sh --vllm"
    h = subprocess.run([SCRIPT, "--help"], capture_output=True, text=True, cwd=ROOT, env=ENV,
                       timeout=120)
    assert h.returncode == 0 and h.stdout.startswith("usage: kvarn-vllm-ladder"), h.stderr
    assert "--kv-cache-dtype" in h.stdout and "--plot" in h.stdout
    get, _ = families
    _, (r, rep, _) = get("llama3")
    assert r.returncode == 0 and rep["formats"][1]["status"] == "ok", r.stderr[-3000:]
    assert get.server.ready["main"] == "kvarn_vllm.ladder.cli:main"
    assert get.server.ready["file"] == os.path.join(ROOT, "python", "kvarn_vllm", "ladder",
                                                    "cli.py")


# ---- an MLA model: make_models.py's "deepseek_v3" (DeepSeek-V3's attention
# shape: per token one 512-wide latent and one 64-wide RoPE key; 2 layers),
# one ladder run of `all` through ladder_serve.py (auto and the six
# kvarn_mla_* formats of `all`, the rest refused rows), shared by the tests
# below; the prompt runs as MHA on the fresh latents, the last MLA_DEC
# tokens are decoded one step at a time, forced to the text's

MLA_CTX = 2 * G + 40             # the decoded positions read 2 records of 128 (4 of 64)
MLA_DEC = 32
MLA_P = MLA_CTX - MLA_DEC        # the prompt: positions [0, MLA_P) read no cache
MLA_BUDGET = 256 * 2**20


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    sys.path.insert(0, os.path.dirname(__file__))
    import make_models
    return make_models.make("deepseek_v3", str(tmp_path_factory.mktemp("ladder_mla")))


def _mla_args(model, ids, js, dtypes="all"):
    return [str(a) for a in ("--model", model, "--token-ids", ids, "--kv-cache-dtype", dtypes,
                             "--ctx", MLA_CTX, "--windows", 1, "--decode", MLA_DEC, "--budget",
                             "256MiB", "--json", js)]


@pytest.fixture(scope="module")
def mla_run(mla_model, families, tmp_path_factory):
    """(model, token ids, CompletedProcess, report, seconds) of the ladder's
    `all` on the MLA model, and the exact fp32 log-probabilities of its
    window (emulate_mla.py, transformers, vLLM's CPU RoPE) for the tests'
    emulated codecs."""
    import emulate_mla
    get, _ = families
    d = tmp_path_factory.mktemp("ladder_mla_run")
    ids = _fam_ids(MLA_CTX)
    (d / "ids.json").write_text(json.dumps(ids))
    r, secs = _serve_ladder(get.server, _mla_args(mla_model, d / "ids.json", d / "r.json"))
    print(f"MLA ladder: {secs:.0f} s\n{r.stdout}")
    rep = json.loads((d / "r.json").read_text()) if (d / "r.json").exists() else None
    exact = emulate_mla.logprobs(mla_model, ids[:-1], MLA_P)
    return dict(model=mla_model, ids=ids, r=r, rep=rep, secs=secs, exact=exact,
                ids_file=d / "ids.json")


def _mla_dims(model):
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    return c["num_hidden_layers"], c["kv_lora_rank"], c["qk_rope_head_dim"]


def test_mla_ladder_rows(mla_run):
    """`all` on an MLA model: the reference (vLLM's fp32 MLA cache, run with
    attention_backend CPU_MLA) and a row for each of the six kvarn_mla_*
    formats of `all` (served by the plug-in's KVARN_MLA backend); vLLM's
    bf16 and fp8 caches, which vLLM's CPU_MLA does not hold, the K/V presets
    and the per-token formats are refused rows with a one-line
    reason. The reference's decode columns are decoded with the text's
    tokens forced: its PPL over every position is transformers' fp32 NLL
    on the text (emulate_mla.py) to 1e-4, which it would not be had a
    decoded token left the text."""
    import math
    import numpy as np
    from kvarn_vllm.ladder import ALL_MLA, ALL_PER_TOKEN, ALL_PRESETS
    r, rep = mla_run["r"], mla_run["rep"]
    assert r.returncode == 0, r.stderr[-4000:]
    assert rep["mla"] and rep["decode_mode"] == "forced" and rep["kld_mode"] == "exact"
    assert not any("capacity not computed" in w or "not vLLM's" in w or "MLA" in w
                   for w in rep["warnings"]), rep["warnings"]
    ok = [f["label"] for f in rep["formats"] if f["status"] in ("ok", "reference")]
    assert ok == ["auto"] + list(ALL_MLA), ok
    why = {f["label"]: f["reason"] for f in rep["formats"] if f["status"] == "refused"}
    for name in ("bfloat16", "fp8_e4m3", "fp8_e5m2"):
        assert "CPU_MLA" in why[name] and "supported_kv_cache_dtypes" in why[name], why
    for name in ALL_PRESETS:
        assert "multi-head latent attention" in why[name] and "K and V tiles" in why[name], why
    for name in ALL_PER_TOKEN:
        assert "multi-head latent attention" in why[name] and "K and V records" in why[name]
    assert all("\n" not in w for w in why.values())
    ref = _row(rep, "auto")
    assert ref["attention_backends"] == ["CPU_MLA"]
    assert all(_row(rep, n)["attention_backends"] == ["KVARN_MLA"] for n in ALL_MLA)
    ids, exact = mla_run["ids"], mla_run["exact"]
    nll = float(-np.mean(exact[np.arange(MLA_CTX - 1), ids[1:]]))
    print(f"reference ln PPL {math.log(ref['ppl']):.6f}, transformers fp32 {nll:.6f}")
    assert abs(math.log(ref["ppl"]) - nll) < 1e-4
    assert "MLA model:" in r.stdout and "forced to the text's" in r.stdout
    assert "MLA tail pool counted" in r.stdout


@pytest.mark.parametrize("name", ["kvarn_mla_k4_g128", "kvarn_mla_k4_g64", "kvarn_mla_k2_g128",
                                  "kvarn_mla_k2_g64", "kvarn_mla_k8_g128", "kvarn_mla_k8_g64"])
def test_mla_format_ladder(name, mla_run):
    """One kvarn_mla_* row of the shared run: the positions as asked (the
    prompt's MLA_P - 1 and the first step's, then MLA_DEC - 1 decoded); its
    bytes per token the record's (_lib.mla_record_bytes / G, every layer);
    its KV tokens vLLM's blocks for the budget less the fp32 tail pool
    (mla_backend.tail_pool_bytes: max_num_seqs slots of G tokens of
    latent + RoPE key per layer) over one record per layer, in blocks of G,
    at the largest max_num_seqs n that fits n requests (n + 1 does not);
    its decode KLD (exact) positive and within [K_e / 2, 2 K_e] of the
    codec's effect K_e on the same tokens without vLLM (emulate_mla.py:
    each whole tile through kvarn_mla_encode / decode, the read rule of
    the decoded positions; test_mla's rule); its prompt columns, which read
    no cache, far below that (MHA on the fresh latents: 0 here)."""
    import emulate_mla
    from kvarn_vllm import _lib
    rep = mla_run["rep"]
    assert rep is not None, mla_run["r"].stderr[-4000:]
    f = _row(rep, name)
    assert f["status"] == "ok", f
    layers, latent, rope = _mla_dims(mla_run["model"])
    fmt = _lib.mla_parse(name, latent, rope)
    G_ = fmt.tile_tokens
    rb = _lib.mla_record_bytes(fmt, latent, rope)
    assert f["prompt_positions"] == MLA_P and f["decode_positions"] == MLA_DEC - 1
    assert f["decode_kld_partial"] == 0 == f["kld_partial"]
    assert f["bytes_per_token"] == layers * rb / G_ and f["block_size"] == G_
    cdiv = lambda a, b: -(-a // b)                      # noqa: E731
    pool = lambda n: layers * n * G_ * (latent + rope) * 4     # noqa: E731
    blocks = lambda n: (MLA_BUDGET - pool(n)) // (layers * rb)  # noqa: E731
    n, per_req = f["max_num_seqs"], cdiv(MLA_CTX, G_)
    assert f["pool_bytes"] == pool(n) and f["blocks_per_request"] == per_req
    assert f["kv_tokens"] == blocks(n) * G_, f
    assert f["requests_fit"] == n and (blocks(n) - 1) // per_req >= n
    assert (blocks(n + 1) - 1) // per_req < n + 1
    ref = _row(rep, "auto")          # vLLM's fp32 MLA cache: 576 channels x 4 bytes, blocks of 16
    assert ref["bytes_per_token"] == layers * (latent + rope) * 4 and ref["block_size"] == 16
    assert ref["kv_tokens"] == MLA_BUDGET // (layers * 16 * (latent + rope) * 4) * 16
    codec = emulate_mla.logprobs(mla_run["model"], mla_run["ids"][:-1], MLA_P,
                                 roundtrip=emulate_mla.MlaCodec(name, latent, rope), G=G_)
    k_e = float(emulate_mla.kl_rows(mla_run["exact"], codec)[MLA_P:].mean())
    k_v = f["decode_kld_mean"]
    print(f"{name}: {f['bytes_per_token']:.0f} B/token, KV tokens {f['kv_tokens']} (fp32 "
          f"{ref['kv_tokens']}), fit {f['requests_fit']}; decode KLD ladder {k_v:.6f}, "
          f"emulated codec {k_e:.6f}; prompt KLD mean {f['kld_mean']:.2e}")
    assert k_v > 0 and k_e / 2 <= k_v <= 2 * k_e
    assert f["kld_mean"] <= k_v / 100 and f["kld_max"] <= k_v / 10


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
    staging run, after vLLM's fp8 the plug-in's per-token formats in the
    staircase's order (fp8, int8, int4, then KVarN); nothing refused but
    the MLA names on a model without MLA (not checked here: no model)."""
    from kvarn_vllm import ladder
    from kvarn_vllm.ladder import formats
    jobs, refused = ladder.expand_formats("all", formats._vllm_cache_dtypes())
    labels = [j.label for j in jobs]
    assert labels[0] == "auto" and not any(j.explicit for j in jobs)
    for name in ("fp8_e4m3", "fp8_e5m2", "kvarn_k4v2_g64", "kvarn_k4v4_g64",
                 f"{KV}:KVARN_STAGING=int4", f"{KV}c", "kvarn_k4v4_g64c"):
        assert name in labels
    stair = ["fp8_e5m2", "kvarn_fp8_e4m3", "kvarn_fp8_e5m2", "kvarn_int8", "kvarn_int4",
             "kvarn_k4v2_g128"]
    assert [labels.index(n) for n in stair] == sorted(labels.index(n) for n in stair), labels
    assert refused == [], refused     # (without the model, no MLA row either)


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
    # an MLA record format: read by decoded positions from G - 1 = 127 on,
    # never by the prompt's (whatever the format: no warning for those)
    mla = [Job("auto", "auto", {}, True), Job("kvarn_mla_k4_g128", "kvarn_mla_k4_g128", {}, True)]
    assert coverage_warnings(mla, MLA_CTX, MLA_DEC) == []
    w = coverage_warnings(mla, 100, 32)
    assert len(w) == 1 and "decode columns of kvarn_mla_k4_g128" in w[0] and "--ctx 129" in w[0]
    assert coverage_warnings(mla, 129, 32) == []


@pytest.mark.parametrize("label,needle", [
    (f"{KV}:KVARN_STAGNG=fp16", "KVARN_STAGNG is not a setting of the plug-in"),
    (f"{KV}:KVARN_SLIDING_WINDOW=yes", "KVARN_SLIDING_WINDOW must be 'vllm'"),
    (f"{KV}:KVARN_ATTN_THREADS=-1", "KVARN_ATTN_THREADS must be a whole number"),
    (f"{KV}:KVARN_PREFILL_COMMIT=direct", "KVARN_PREFILL_COMMIT must be exact or staged"),
])
def test_settings_checked_without_an_engine(label, needle):
    """A misspelt or ill-valued setting is a usage error before any engine
    (not a run of the defaults under the label); the environment is left
    as it was."""
    from kvarn_vllm import ladder
    from kvarn_vllm.ladder import formats
    before = os.environ.get("KVARN_SLIDING_WINDOW")
    with pytest.raises(ladder.UsageError, match=needle):
        formats._check_format(label, formats._vllm_cache_dtypes())
    assert os.environ.get("KVARN_SLIDING_WINDOW") == before
    ok = formats._check_format(f"{KV}:KVARN_SLIDING_WINDOW=quantize",
                               formats._vllm_cache_dtypes())
    assert ok.env == {"KVARN_SLIDING_WINDOW": "quantize"}


@pytest.mark.parametrize("opt", ["--json", "--plot"])
def test_output_path_checked_before_the_run(hf_model, tmp_path, capsys, opt):
    """--json / --plot into a directory that is not there: exit 2 at once,
    not after the engines ran."""
    from kvarn_vllm import ladder
    bad = str(tmp_path / "no-such-dir" / "out")
    rc = ladder.main(["--model", hf_model, "--text", AUSTEN, "--kv-cache-dtype", KV, opt, bad])
    err = capsys.readouterr().err
    assert rc == 2 and f"{opt} {bad}: its directory" in err, err
    assert "starting the engine" not in err


def _facts(mla: bool, dtype: str = "float32"):
    from kvarn_vllm.ladder import ModelFacts
    return ModelFacts("m", mla, 512 if mla else 0, 64 if mla else 0, dtype)


def test_mla_names_without_an_engine():
    """`all` on an MLA model runs auto and the six kvarn_mla_* formats of
    ALL_MLA (RoPE key at 8 bits), the rest refused rows; on a model without
    MLA today's rows and one refused row for every kvarn_mla_* name. Every
    one of the plug-in's 18 MLA names (mla_dtype_names: the r8 / r16
    variants too) passes the checks on an MLA model, each with the record
    bytes of docs/mla.md's table (latent 512 + RoPE 64: k4 = k4r8 342,
    k4r16 402, k2r8 214 bytes per token and layer at G = 128)."""
    from kvarn_vllm import _lib, ladder
    from kvarn_vllm.ladder import formats
    names = formats._vllm_cache_dtypes()
    jobs, refused = ladder.expand_formats("all", names, _facts(True))
    assert [j.label for j in jobs] == ["auto"] + list(ladder.ALL_MLA)
    why = dict(refused)
    assert {"bfloat16", "fp8_e4m3", "fp8_e5m2", *ladder.ALL_PRESETS,
            *ladder.ALL_PER_TOKEN} == set(why), why
    jobs0, _ = ladder.expand_formats("all", names)
    jobs1, refused1 = ladder.expand_formats("all", names, _facts(False))
    assert [j.label for j in jobs1] == [j.label for j in jobs0]
    mla_rows = [r for r in refused1 if "mla" in r[0]]
    assert len(mla_rows) == 1 and mla_rows[0][0] == "kvarn_mla_*", refused1
    assert "has no MLA layers" in mla_rows[0][1]
    per_token = {}
    for n in _lib.mla_dtype_names():
        assert formats._check_format(n, names, _facts(True)).name == n
        fmt = _lib.mla_parse(n, 512, 64)
        per_token[n] = _lib.mla_record_bytes(fmt, 512, 64) / fmt.tile_tokens
    assert len(per_token) == 18
    assert per_token["kvarn_mla_k4_g128"] == per_token["kvarn_mla_k4r8_g128"] == 342
    assert per_token["kvarn_mla_k4r16_g128"] == 402 and per_token["kvarn_mla_k2_g128"] == 214


def test_vllm_mla_backend_choice(monkeypatch):
    """vLLM's own MLA cache rows: CPU_MLA asked for unless the weights are
    bf16; with bf16 weights vLLM's choice (AMX_MLA where the CPU has AMX
    tiles, else CPU_MLA); the bf16 and fp8 caches refused against the
    backend's own supported_kv_cache_dtypes."""
    import torch
    from kvarn_vllm import ladder
    from kvarn_vllm.ladder import formats
    for amx in (False, True):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        assert ladder.vllm_mla_backend("float32") == ("CPU_MLA", "CPU_MLA")
        assert ladder.vllm_mla_backend("float16") == ("CPU_MLA", "CPU_MLA")
        assert ladder.vllm_mla_backend("bfloat16") == (None, "AMX_MLA" if amx else "CPU_MLA")
    assert formats._vllm_mla_refusal("auto", "CPU_MLA") == ""
    assert "auto only" in formats._vllm_mla_refusal("bfloat16", "CPU_MLA")
    assert formats._vllm_mla_refusal("bfloat16", "AMX_MLA") == ""


@pytest.mark.parametrize("which,dtypes,needle", [
    ("mla", "kvarn_k4v2_g128", "stores K and V tiles per KV head"),
    ("mla", "kvarn_k4v4_g64:KVARN_STAGING=fp16", "stores K and V tiles per KV head"),
    ("mla", "kvarn_mla_k4_g128:KVARN_STAGING=fp16", "take none of the plug-in's settings"),
    ("mla", "kvarn_mla_k4_g128:x", "a setting after ':' is KVARN_NAME=VALUE"),
    ("mla", "kvarn_mla_k3_g128", "unknown MLA cache format 'kvarn_mla_k3_g128'"),
    ("mla", "auto,bfloat16", "holds kv_cache_dtype auto only"),
    ("mla", "fp6", "unknown --kv-cache-dtype 'fp6'"),
    ("mla", "int8", "through vLLM it is kvarn_int8"),
    ("smol", "kvarn_mla_k4_g128", "has no MLA layers"),
    ("smol", "kvarn_mla_k8r16_g64", "has no MLA layers"),
    ("smol", "kvarn_mla_k4_g32", "unknown MLA cache format"),
])
def test_mla_names_refused_in_one_line(which, dtypes, needle, mla_model, hf_model, capsys):
    """Each name a user can give on an MLA model or, for the MLA names, on
    SmolLM2: a one-line usage error (exit 2) before any engine, no
    traceback."""
    from kvarn_vllm import ladder
    model = mla_model if which == "mla" else hf_model
    rc = ladder.main(["--model", model, "--text", AUSTEN, "--kv-cache-dtype", dtypes])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("kvarn-vllm-ladder")]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("kvarn-vllm-ladder: error: "), err
    assert needle in lines[0], lines[0]
    assert "Traceback" not in err and "starting the engine" not in err


def test_mla_engine_arguments(monkeypatch, mla_model):
    """What _measure asks of vLLM on an MLA model, read from a stand-in for
    LLM (no engine), on a CPU faked to have AMX tiles (where vLLM 0.32
    would pick AMX_MLA, which takes bf16 weights only): vLLM's own cache at
    --dtype float32 with attention_backend CPU_MLA; a kvarn_mla_* format
    with its tile as the block size and no attention_backend (the plug-in
    picks its KVARN_MLA backend); both with the forcing logits processor
    and raw log-probabilities. (Run by hand with the faked AMX and real
    engines, docs/eval.md "Through vLLM": "Using CPU_MLA backend" in the
    reference's log and the numbers of a run without it; without the
    CPU_MLA request vLLM picks AMX_MLA.)"""
    import torch
    import vllm
    import vllm.v1.engine.core as core
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from kvarn_vllm import ladder
    from kvarn_vllm.ladder import engine
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(core, "get_kv_cache_configs", core.get_kv_cache_configs)
    seen = []

    class Stop(Exception):
        pass

    def llm(**kw):
        seen.append(kw)
        raise Stop
    monkeypatch.setattr(vllm, "LLM", llm)
    mla, latent, rope, dtype = ladder.model_uses_mla(mla_model)
    facts = ladder.ModelFacts(mla_model, mla, latent, rope, "float32")
    assert (mla, latent, rope, dtype) == (True, 512, 64, "float32")
    cfg = dict(model=mla_model, dtype="float32", ctx=MLA_CTX, windows=[], top=2048,
               budget=MLA_BUDGET, engine_kv=2**30, max_num_seqs=None,
               max_num_batched_tokens=4096, decode=MLA_DEC, mla=True,
               attention_backend=facts.backend_asked)
    for name in ("auto", "kvarn_mla_k4_g64"):
        with pytest.raises(Stop):
            engine._measure(ladder.Job(name, name, {}, True), cfg, print)
    auto, kv = seen
    assert auto["attention_backend"] == "CPU_MLA" and "block_size" not in auto
    assert "attention_backend" not in kv and kv["block_size"] == 64
    for kw in (auto, kv):
        proc, = kw["logits_processors"]
        assert issubclass(proc, LogitsProcessor) and kw["logprobs_mode"] == "raw_logprobs"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert ladder.ModelFacts(mla_model, True, 512, 64, "bfloat16").backend_asked is None


def test_forced_tokens_processor():
    """The forcing logits processor on a batch of two requests (vLLM's
    BatchUpdate protocol): the one whose extra_args name tokens gets, at
    its k-th step, every logit but token k's at -inf (so greedy sampling
    picks it) and is left alone past the list; the other is untouched;
    a removed request is forgotten."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate
    from kvarn_vllm.ladder.engine import FORCE_ARG, _forced_tokens_processor
    proc = _forced_tokens_processor()(None, torch.device("cpu"), False)
    assert not proc.is_argmax_invariant()
    out = []
    forced = SamplingParams(extra_args={FORCE_ARG: [5, 7]})
    proc.update_state(BatchUpdate(batch_size=2, removed=[], moved=[],
                                  added=[(0, SamplingParams(), [1], []),
                                         (1, forced, [1, 2], out)]))
    logits = torch.randn(2, 10)
    before = logits.clone()
    for want in (5, 7):
        got = proc.apply(logits.clone())
        assert torch.equal(got[0], before[0])
        assert int(got[1].argmax()) == want and torch.isinf(got[1]).sum() == 9
        out.append(want)
    assert torch.equal(proc.apply(logits.clone()), before)    # past the list
    proc.update_state(BatchUpdate(batch_size=1, removed=[1], moved=[], added=[]))
    assert proc.req == {}
    with pytest.raises(ValueError):
        _forced_tokens_processor().validate_params(SamplingParams(extra_args={FORCE_ARG: "x"}))
