"""`kvarn eval --json` writes valid JSON whatever bytes the model and text
paths hold (issue 8: the CLI's JSON was printf'ed, so a path with a quote or
a backslash broke it). The report is parsed back with Python's json, and the
paths must come back exactly as given."""
import json
import math
import os
import subprocess

import pytest

# Each a part of a directory or file name: JSON's two escaped printables, the
# C0 control characters JSON forbids raw (tab, newline, 0x01, 0x1f, escape),
# DEL, and non-ASCII UTF-8 of 2, 3 and 4 bytes. '/' and NUL cannot be in a
# file name.
HOSTILE = ['q"uote', "back\\slash", "tab\there", "new\nline", "ctl\x01\x1f\x1b",
           "del\x7f", "caf\u00e9", "\u65e5\u672c", "\U0001f389", '\\"\\\\" ']


def run_eval(kvarn_bin, model, text, extra=()):
    return subprocess.run(
        [kvarn_bin, "eval", "-m", model, "-f", text, "--ctx", "24", "--chunk", "8",
         "--decode-tokens", "2", "--kv-cache-dtype", "int8,kvarn_k4v2_g64", "--json", *extra],
        capture_output=True, timeout=600)


@pytest.fixture(scope="module")
def hostile_paths(tmp_path_factory, model_path):
    """The model (a symlink) and a short text, both under directories and
    names made of HOSTILE."""
    base = tmp_path_factory.mktemp("json")
    d = base / "".join(HOSTILE[:5])
    d.mkdir()
    model = d / ("m" + "".join(HOSTILE[5:]) + ".gguf")
    os.symlink(os.path.abspath(model_path), model)
    text = d / ("t" + "".join(HOSTILE) + ".txt")
    text.write_text("It is a truth universally acknowledged, that a single man in possession "
                    "of a good fortune, must be in want of a wife. " * 3, encoding="utf-8")
    return str(model), str(text)


def test_eval_json_with_hostile_paths(kvarn_bin, hostile_paths):
    model, text = hostile_paths
    r = run_eval(kvarn_bin, model, text)
    assert r.returncode == 0, r.stderr.decode("utf-8", "replace")
    out = r.stdout.decode("utf-8")   # valid UTF-8, or this raises
    rep = json.loads(out)            # strict: raw control characters are refused
    assert rep["model"] == model
    assert rep["text"] == text
    assert rep["ctx"] == 24 and rep["chunk"] == 8 and rep["decode_tokens"] == 2
    assert [f["format"] for f in rep["formats"]] == ["int8", "kvarn_k4v2_g64"]
    assert rep["reference"]["format"] == "fp16"
    # Every number is a finite JSON number (printf would write inf/nan, which
    # are not JSON); the positions scored are ctx - 1 per window.
    for row in rep["formats"]:
        for k, v in row.items():
            if k == "warnings":
                assert all(isinstance(x, str) for x in v), v
            elif k in ("passkey", "passkey_trials"):
                assert v is None, (k, v)  # no --passkey: nothing measured
            elif k != "format":
                assert isinstance(v, (int, float)) and math.isfinite(v), (k, v)
        assert row["positions"] == 23
        assert row["kld_mean"] >= 0 and 0 <= row["top1"] <= 1
    assert math.isfinite(rep["reference"]["ppl"]) and rep["reference"]["ppl"] > 1


def test_eval_sink_tokens(kvarn_bin, model_path, austen_path):
    """`--sink-tokens S` reaches the cache: S = 64 on a 64-token tile is the
    default sink (one whole tile) to the last bit of every number; S = 16
    keeps the rest of tile 0 quantized, so it differs from both S = 64 and
    S = 0 (no sink), and its effective bytes per token lie between theirs
    (its fp16 part is 16 tokens, not 64 or none)."""
    text = str(austen_path)

    def rep(*extra):
        r = subprocess.run(
            [kvarn_bin, "eval", "-m", model_path, "-f", text, "--ctx", "200", "--chunk", "32",
             "--decode-tokens", "8", "--kv-cache-dtype", "kvarn_k4v2_g64", "--json", *extra],
            capture_output=True, timeout=600)
        assert r.returncode == 0, r.stderr.decode("utf-8", "replace")
        return json.loads(r.stdout.decode("utf-8"))

    default, s64, s16, s0 = rep(), rep("--sink-tokens", "64"), rep("--sink-tokens", "16"), \
        rep("--sink-tokens", "0")
    assert default["sink_tokens"] == -1 and s16["sink_tokens"] == 16 and s0["sink_tokens"] == 0
    quality = ("kld_mean", "kld_max", "decode_kld_mean", "ppl", "top1", "effective_bytes_per_token")
    d, a, b, z = (x["formats"][0] for x in (default, s64, s16, s0))
    for k in quality:
        assert d[k] == a[k], k
    assert b["kld_mean"] != a["kld_mean"] and b["kld_mean"] != z["kld_mean"]
    assert z["effective_bytes_per_token"] < b["effective_bytes_per_token"] < a["effective_bytes_per_token"]


# ---- columns that measured nothing, and eval's warnings, in the JSON ----
# (fresh-user trial: with no decoded position scored the report said
# decode_kld_mean 0 and decode_top1 0, a perfect KLD and no agreement at
# all; with --decode-tokens 0, decode_tok_s 0; and the "measure no quantized
# K/V" warnings were on stderr only.)

DECODE_SCORES = ("decode_kld_mean", "decode_kld_p99", "decode_top1")


def eval_json(kvarn_bin, model, text, *args):
    r = subprocess.run([kvarn_bin, "eval", "-m", model, "-f", text, "--ctx", "32", "--chunk", "8",
                        "--kv-cache-dtype", "int8,kvarn_k4v2_g64", "--json", *args],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    warned = [line[len("kvarn eval: warning: "):] for line in r.stderr.splitlines()
              if line.startswith("kvarn eval: warning: ")]
    return json.loads(r.stdout), warned


@pytest.fixture(scope="module")
def short_text(tmp_path_factory):
    text = tmp_path_factory.mktemp("nulls") / "text.txt"
    text.write_text("It is a truth universally acknowledged. " * 8)
    return str(text)


def test_eval_json_nothing_decoded_is_null(kvarn_bin, model_path, short_text):
    rep, warned = eval_json(kvarn_bin, model_path, short_text, "--decode-tokens", "0")
    assert rep["reference"]["decode_tok_s"] is None, rep["reference"]
    for row in rep["formats"]:
        assert row["decode_positions"] == 0, row
        for k in DECODE_SCORES + ("decode_tok_s", "decode_x_fp16"):
            assert row[k] is None, (k, row)
        # what was measured stays a number
        assert row["chunk_positions"] == 31 and row["kld_mean"] >= 0 and 0 <= row["top1"] <= 1
    # the chunk-fed columns of this short window measure nothing quantized:
    # warned on stderr and in the report, the same words
    assert warned and rep["warnings"] == warned, (rep["warnings"], warned)


def test_eval_json_one_decoded_token_scores_nothing(kvarn_bin, model_path, short_text):
    # one decoded token: timed, but the window's last token predicts nothing
    rep, warned = eval_json(kvarn_bin, model_path, short_text, "--decode-tokens", "1")
    assert rep["reference"]["decode_tok_s"] > 0
    for row in rep["formats"]:
        assert row["decode_positions"] == 0, row
        for k in DECODE_SCORES:
            assert row[k] is None, (k, row)
        assert row["decode_tok_s"] > 0 and row["decode_x_fp16"] > 0, row
    assert rep["warnings"] == warned, (rep["warnings"], warned)
    one = [w for w in warned if w.startswith("--decode-tokens 1 scores no decoded position")]
    assert len(one) == 1, warned
    # each format's own list: the warnings that name it, and the one about
    # --decode-tokens 1, which concerns every format
    for row in rep["formats"]:
        assert one[0] in row["warnings"], row
        for w in row["warnings"]:
            assert w in rep["warnings"]
        for w in rep["warnings"]:
            if "measure no quantized K/V" in w:
                assert (w in row["warnings"]) == (row["format"] in w.split(" measure ")[0]), (w, row)


def test_eval_json_warnings_empty_when_all_measured(kvarn_bin, model_path, austen_path):
    # 256 tokens, chunks of 32, 16 decoded: int8 and kvarn_k4v2_g64 (G = 64,
    # S = 64) see quantized history in both parts: no warning
    r = subprocess.run([kvarn_bin, "eval", "-m", model_path, "-f", austen_path, "--ctx", "256",
                        "--chunk", "32", "--decode-tokens", "16",
                        "--kv-cache-dtype", "int8,kvarn_k4v2_g64", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr, r.stderr
    rep = json.loads(r.stdout)
    assert rep["warnings"] == [] and all(row["warnings"] == [] for row in rep["formats"]), rep
    for row in rep["formats"]:
        assert row["decode_positions"] == 15
        for k in DECODE_SCORES + ("decode_tok_s", "decode_x_fp16"):
            assert isinstance(row[k], (int, float)) and not isinstance(row[k], bool), (k, row)


# Bytes that are not UTF-8, each to become U+FFFD per maximal subpart (as
# Python's decode("utf-8", "replace")): a lone 0xFF, a stray continuation
# byte, an overlong '/', a surrogate, a code point above U+10FFFF, a 3-byte
# sequence cut short, and a 4-byte lead at the end of the name.
NOT_UTF8 = [b"x\xffy", b"c\x80", b"o\xc0\xaf", b"s\xed\xa0\x80", b"b\xf4\x90\x80\x80",
            b"t\xe2\x82.", b"\xf0\x9f"]


def test_eval_json_paths_not_utf8(kvarn_bin, model_path, tmp_path):
    """A path is bytes; the report stays valid UTF-8 JSON, the invalid bytes
    as U+FFFD (README: "valid JSON whatever the paths hold")."""
    d = os.fsencode(tmp_path) + b"/" + b"".join(NOT_UTF8[:3])
    os.mkdir(d)
    model = d + b"/m" + b"".join(NOT_UTF8[3:]) + b".gguf"
    os.symlink(os.path.abspath(model_path), model)
    text = d + b"/t" + b"".join(NOT_UTF8) + b".txt"
    with open(text, "w", encoding="utf-8") as f:
        f.write("It is a truth universally acknowledged, that a single man in possession "
                "of a good fortune, must be in want of a wife. " * 3)
    r = subprocess.run([kvarn_bin, "eval", "-m", model, "-f", text, "--ctx", "24", "--chunk", "8",
                        "--decode-tokens", "2", "--kv-cache-dtype", "int8", "--json"],
                       capture_output=True, timeout=600)
    assert r.returncode == 0, r.stderr.decode("utf-8", "replace")
    rep = json.loads(r.stdout.decode("utf-8"))  # strict UTF-8, or this raises
    assert rep["model"] == model.decode("utf-8", "replace")
    assert rep["text"] == text.decode("utf-8", "replace")
    assert rep["model"].count("\ufffd") == 13


def test_eval_json_options_used_and_lowered(kvarn_bin, model_path, short_text):
    """No --passkey: passkey and passkey_trials are null (nothing measured),
    not 0. Each format reports the sink and tail page tokens its cache uses
    (the default sink is one tile: G), the top level --sink-tokens (-1: not
    given) and --tail-page-tokens as given. Options lowered to fit the text
    are warnings, on stderr and in the report, like every other."""
    r = subprocess.run([kvarn_bin, "eval", "-m", model_path, "-f", short_text, "--ctx", "500",
                        "--windows", "3", "--decode-tokens", "100", "--tail-page-tokens", "16",
                        "--kv-cache-dtype", "int8,kvarn_k4v2_g64,kvarn_k4v2_g128", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    warned = [line[len("kvarn eval: warning: "):] for line in r.stderr.splitlines()
              if line.startswith("kvarn eval: warning: ")]
    assert rep["warnings"] == warned
    n, ctx = rep["tokens"], rep["ctx"]
    assert ctx == n < 500
    assert f"the text holds {n} tokens: --ctx lowered to {n}" in warned
    assert f"the text holds {n} tokens: --windows lowered to 1 (windows of {n})" in warned
    assert any(w.startswith(f"--decode-tokens 100 lowered to {n - 1} (--ctx - 1)") for w in warned)
    assert not [l for l in r.stderr.splitlines() if "lowered" in l and "warning: " not in l]
    assert rep["sink_tokens"] == -1 and rep["tail_page_tokens"] == 16
    for row in [rep["reference"]] + rep["formats"]:
        assert row["passkey"] is None and row["passkey_trials"] is None, row
    by = {f["format"]: f for f in rep["formats"]}
    assert (by["int8"]["sink_tokens"], by["int8"]["tail_page_tokens"]) == (0, 0)
    assert (by["kvarn_k4v2_g64"]["sink_tokens"], by["kvarn_k4v2_g64"]["tail_page_tokens"]) == (64, 16)
    assert (by["kvarn_k4v2_g128"]["sink_tokens"], by["kvarn_k4v2_g128"]["tail_page_tokens"]) == (128, 16)
