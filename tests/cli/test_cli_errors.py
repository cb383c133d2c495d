"""Bad inputs to the kvarn command: each a clear message on stderr and a
non-zero exit, nothing else broken (issue: the kvarn command, tests)."""
import json
import re
import subprocess

import pytest


def run(args, **kw):
    kw.setdefault("timeout", 600)
    return subprocess.run(args, capture_output=True, text=True, **kw)


def test_help_of_every_command(kvarn_bin):
    top = run([kvarn_bin, "--help"])
    assert top.returncode == 0
    for cmd in ("generate", "eval", "passkey", "inspect"):
        assert cmd in top.stdout
        r = run([kvarn_bin, cmd, "--help"])
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(f"usage: kvarn {cmd}")


def test_unknown_command_and_option(kvarn_bin):
    r = run([kvarn_bin, "frobnicate"])
    assert r.returncode == 2 and "unknown command" in r.stderr
    r = run([kvarn_bin, "inspect", "--bogus", "1"])
    assert r.returncode == 2 and "unknown option" in r.stderr


def test_missing_model_says_how_to_get_one(kvarn_bin, tmp_path):
    for cmd in (["generate", "-p", "hi"], ["eval", "-f", "/dev/null"], ["passkey"], ["inspect"]):
        r = run([kvarn_bin, cmd[0], "-m", str(tmp_path / "nope.gguf")] + cmd[1:])
        assert r.returncode == 1, (cmd, r.stderr)
        assert "not found" in r.stderr and "scripts/setup.sh --model" in r.stderr


def test_truncated_gguf(kvarn_bin, model_path, tmp_path):
    data = open(model_path, "rb").read(1 << 20)
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data)
    r = run([kvarn_bin, "generate", "-m", str(bad), "-p", "hi"])
    assert r.returncode == 1
    assert "malformed or truncated" in r.stderr or "truncated" in r.stderr
    # cut in the header: said "malformed or truncated file: truncated file: ..."
    bad.write_bytes(data[:20])
    r = run([kvarn_bin, "inspect", "-m", str(bad)])
    assert r.returncode == 1
    assert ("malformed or truncated file: the file ends early: metadata count at byte 16 "
            "needs 8 bytes, only 4 left") in r.stderr, r.stderr
    assert "truncated file: truncated" not in r.stderr, r.stderr
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOTAGGUF" * 100)
    r = run([kvarn_bin, "inspect", "-m", str(junk)])
    assert r.returncode == 1 and "cannot read" in r.stderr


def test_unknown_cache_format_lists_accepted(kvarn_bin, model_path):
    for cmd in (["generate", "-m", model_path, "-p", "hi"], ["eval", "-m", model_path, "-f", "x"],
                ["passkey", "-m", model_path],
                ["inspect", "--layers", "1", "--kv-heads", "1", "--head-dim", "64"]):
        r = run([kvarn_bin] + cmd + ["--kv-cache-dtype", "int3"])
        assert r.returncode == 2, (cmd, r.stderr)
        assert "unknown cache format 'int3'" in r.stderr
        assert "kvarn_k4v2_g128" in r.stderr and "fp8_e4m3" in r.stderr


def test_unsupported_head_dim(kvarn_bin):
    r = run([kvarn_bin, "inspect", "--layers", "2", "--kv-heads", "2", "--head-dim", "96",
             "--kv-cache-dtype", "kvarn_k4v2_g128"])
    assert r.returncode == 1 and "head_dim 96" in r.stderr
    assert r.stdout == ""          # no table without a row
    # a list with a format that can serve it: that row is printed, the exit is still 1
    r = run([kvarn_bin, "inspect", "--layers", "2", "--kv-heads", "2", "--head-dim", "96",
             "--kv-cache-dtype", "kvarn_k4v2_g128,int8"])
    assert r.returncode == 1 and "head_dim 96" in r.stderr
    rows = [line.split()[0] for line in r.stdout.splitlines()]
    assert "int8" in rows and "kvarn_k4v2_g128" not in rows


def test_prompt_longer_than_context(kvarn_bin, model_path):
    # SmolLM2's context is 8192 tokens; " 1" is one or two tokens a time.
    prompt = " 1" * 9000
    r = run([kvarn_bin, "generate", "-m", model_path, "-p", prompt, "-n", "4", "--temp", "0",
             "--kv-cache-dtype", "int8"])
    assert r.returncode == 1
    assert "does not fit in the context" in r.stderr


def test_empty_text_file(kvarn_bin, model_path, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = run([kvarn_bin, "eval", "-m", model_path, "-f", str(empty)])
    assert r.returncode == 1 and "empty" in r.stderr
    r = run([kvarn_bin, "eval", "-m", model_path, "-f", str(tmp_path / "absent.txt")])
    assert r.returncode == 1 and "cannot open" in r.stderr


# Contexts the KV cache cannot hold (issue 8): a clear message naming what
# did not fit and how much was asked, exit code 1, no crash, and no attempt
# to allocate it. SmolLM2-135M: 30 layers x 3 KV heads x head_dim 64; int8
# keeps 2 * 64 + 8 = 136 bytes per token-head (K and V, two fp32 scales).
INT8_BYTES_PER_TOKEN = 30 * 3 * (2 * 64 + 8)


def test_context_beyond_the_library_limit(kvarn_bin, model_path):
    # above KVARN_CACHE_MAX_SEQ_LEN = 2^30 tokens: refused by the plan
    for opt, ctx in (("--ctx", 2147483647), ("--max-tokens", 2 ** 30 + 1)):
        r = run([kvarn_bin, "generate", "-m", model_path, "-p", "hi", "-n", "1",
                 "--kv-cache-dtype", "int8", opt, str(ctx)])
        assert r.returncode == 1, r.stderr
        assert f"cannot allocate the KV cache: " in r.stderr
        assert f"asked for {ctx} tokens x 30 layers x 3 KV heads x 64 channels in int8" in r.stderr
        assert f"at most {2 ** 30} tokens" in r.stderr and "lower --ctx" in r.stderr
        # the K/V bytes of ctx tokens, in TiB with one decimal (cli_fmt_bytes)
        asked = ctx * INT8_BYTES_PER_TOKEN / 2 ** 40
        assert f"{asked:.1f} TiB asked" in r.stderr


def test_context_beyond_this_machine(kvarn_bin, model_path):
    # 10^9 tokens is within the library's limit but needs 10^9 / 16 int8
    # blocks of 16 tokens = 10^9 * 12240 bytes = 11.1 TiB of K/V: refused
    # against RAM + swap before anything is allocated (no machine this runs
    # on has 11 TiB).
    ctx = 10 ** 9
    r = run([kvarn_bin, "generate", "-m", model_path, "-p", "hi", "-n", "1",
             "--kv-cache-dtype", "int8", "--ctx", str(ctx)])
    assert r.returncode == 1, r.stderr
    kv = ctx * INT8_BYTES_PER_TOKEN / 2 ** 40
    assert (f"asked for {ctx} tokens x 30 layers x 3 KV heads x 64 channels in int8 "
            f"({kv:.1f} TiB of K/V") in r.stderr
    assert "this machine has" in r.stderr and "lower --ctx" in r.stderr


def test_context_option_out_of_range(kvarn_bin, model_path):
    for bad in ("0", "-5", "99999999999", "1e9"):
        r = run([kvarn_bin, "generate", "-m", model_path, "-p", "hi", "--ctx", bad])
        assert r.returncode == 2, (bad, r.stderr)
        assert f"bad value '{bad}' for --ctx" in r.stderr and "2147483647" in r.stderr


def test_model_context_length_at_int32_max(kvarn_bin, model_path, tmp_path):
    # The model's own llama.context_length (the default context) patched to
    # INT32_MAX: refused at start with the same message, not a one-block
    # cache that runs out after 16 tokens.
    data = bytearray(open(model_path, "rb").read())
    key = b"llama.context_length"
    at = data.find(key)
    assert at > 0 and data.find(key, at + 1) < 0
    # key string, then the value type (4 = uint32), then the value
    assert int.from_bytes(data[at + len(key):at + len(key) + 4], "little") == 4
    val = at + len(key) + 4
    assert int.from_bytes(data[val:val + 4], "little") == 8192
    data[val:val + 4] = (2 ** 31 - 1).to_bytes(4, "little")
    patched = tmp_path / "ctx_int32_max.gguf"
    patched.write_bytes(bytes(data))
    for fmt in ("int8", "kvarn_k4v2_g128"):
        r = run([kvarn_bin, "generate", "-m", str(patched), "-p", "hi", "-n", "1",
                 "--kv-cache-dtype", fmt])
        assert r.returncode == 1, r.stderr
        assert (f"cannot allocate the KV cache: " in r.stderr and
                f"asked for 2147483647 tokens x 30 layers x 3 KV heads x 64 channels in {fmt}"
                in r.stderr)
    # an explicit context within the model's runs as before
    r = run([kvarn_bin, "generate", "-m", str(patched), "-p", "hi", "-n", "2", "--temp", "0",
             "--kv-cache-dtype", "int8", "--ctx", "64"])
    assert r.returncode == 0, r.stderr


# ---- cache-format lists: one parser, one behaviour (issue 8) -------------
# Every command and benchmark parses its format list with tools/format_list.c:
# an empty item, an unknown name or 'all' inside a list is a usage error
# (exit 2) with the same message everywhere; 'all' alone is every format.

BAD_LISTS = {
    "fp16,,int8": "empty item 2 in the cache-format list 'fp16,,int8'",
    ",int8": "empty item 1 in the cache-format list ',int8'",
    "int8,": "empty item 2 in the cache-format list 'int8,'",
    "": "empty cache-format list",
    "all,int8": "'all' must stand alone",
    "kvarn_k2v2_g128,bogus": "unknown cache format 'bogus'",
}

# Quick settings, so that a benchmark that wrongly accepts a list ends fast.
ATTN_QUICK = ["--contexts", "256", "--batches", "1", "--threads", "1", "--shapes", "smol",
              "--min-time", "0.001", "--working-set", "0"]
CODEC_QUICK = ["--runs", "1", "--min-ms", "1", "--dim", "64"]


def bench_bin(name):
    from conftest import BUILD
    exe = BUILD / name
    assert exe.exists(), f"{exe} is missing: a full build (cmake --build build) makes it"
    return str(exe)


def list_commands(kvarn_bin, model_path, dtypes):
    """(label, argv, prefix of its error line) of every user of a format list."""
    return [
        ("generate", [kvarn_bin, "generate", "-m", model_path, "-p", "hi", "--kv-cache-dtype", dtypes],
         "kvarn generate: "),
        ("eval", [kvarn_bin, "eval", "-m", model_path, "-f", "absent.txt", "--kv-cache-dtype", dtypes],
         "kvarn eval: "),
        ("passkey", [kvarn_bin, "passkey", "-m", model_path, "--kv-cache-dtype", dtypes], "kvarn passkey: "),
        ("inspect", [kvarn_bin, "inspect", "--layers", "1", "--kv-heads", "1", "--head-dim", "64",
                     "--kv-cache-dtype", dtypes], "kvarn inspect: "),
        ("bench_attn", [bench_bin("bench_attn"), "--formats", dtypes] + ATTN_QUICK,
         "bench_attn: --formats: "),
        ("bench_codec", [bench_bin("bench_codec"), "--format", dtypes] + CODEC_QUICK,
         "bench_codec: --format: "),
        # a missing model: a list wrongly accepted fails on the model instead
        ("bench_decode", [bench_bin("bench_decode"), "-m", "absent.gguf", "--kv-cache-dtype", dtypes],
         "bench_decode: --kv-cache-dtype: "),
    ]


@pytest.mark.parametrize("dtypes", list(BAD_LISTS))
def test_bad_format_list_same_error_everywhere(kvarn_bin, model_path, dtypes):
    messages = {}
    for label, argv, prefix in list_commands(kvarn_bin, model_path, dtypes):
        r = run(argv)
        assert r.returncode == 2, (label, r.returncode, r.stderr)
        line = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
        assert line.startswith(prefix), (label, r.stderr)
        assert BAD_LISTS[dtypes] in line, (label, line)
        assert "accepted: " in line and "kvarn_k4v2_g128" in line and "fp8_e4m3" in line, (label, line)
        messages[label] = line[len(prefix):]
    assert len(set(messages.values())) == 1, messages


def inspect_rows(kvarn_bin, dtypes):
    r = run([kvarn_bin, "inspect", "--layers", "2", "--kv-heads", "2", "--head-dim", "64",
             "--kv-cache-dtype", dtypes])
    assert r.returncode == 0, r.stderr
    # a shape line and the heading line, then one row per format until the notes
    lines = r.stdout.splitlines()
    assert lines[1].startswith("format "), r.stdout
    rows = []
    for line in lines[2:]:
        if line.startswith("tokens fit:"):
            break
        rows.append(line)
    return rows


def test_all_expands_to_every_format(kvarn_bin):
    rows = inspect_rows(kvarn_bin, "all")
    names = [row.split()[0] for row in rows]
    # 'all' is the table in ladder order; the same names listed one by one
    # give the same rows.
    assert names[:6] == ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]
    assert "kvarn_k4v2_g128" in names and len(names) == len(set(names))
    assert inspect_rows(kvarn_bin, ",".join(names)) == rows
    # accepted names outside the table (aliases, any k/v/g) are accepted too
    extra = inspect_rows(kvarn_bin, "fp8,auto,kvarn_k2v2_g128")
    assert [row.split()[0] for row in extra] == ["fp8_e4m3", "fp16", "kvarn_k2v2_g128"]


def test_generate_takes_one_format(kvarn_bin, model_path):
    r = run([kvarn_bin, "generate", "-m", model_path, "-p", "hi", "--kv-cache-dtype", "int8,fp16"])
    assert r.returncode == 2 and "names 2 cache formats; generate takes one" in r.stderr


def test_bench_attn_runs_every_accepted_name(kvarn_bin):
    # kvarn_k2v2_g128 is not a table row but the library accepts it: it must
    # run (it was silently dropped), after the fp16 baseline.
    r = run([bench_bin("bench_attn"), "--formats", "kvarn_k2v2_g128,int8"] + ATTN_QUICK)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith("smol ")]
    assert [row[4] for row in rows] == ["fp16", "kvarn_k2v2_g128", "int8"], r.stdout
    for row in rows:
        assert float(row[5]) > 0, row   # us/call measured


def test_bench_codec_runs_a_list(kvarn_bin):
    r = run([bench_bin("bench_codec"), "--format", "kvarn_k2v2_g128,int8"] + CODEC_QUICK)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.split()[:2] in
            (["kvarn_k2v2_g128", "64"], ["int8", "64"])]
    assert [row[0] for row in rows] == ["kvarn_k2v2_g128", "int8"], r.stdout
    assert "not served" not in r.stdout


# bench_attn's other lists (issue 8's kind: a name or number it does not
# take is an error, never a silent empty run). Before: '--shapes smoll' ran
# nothing (strstr), '--contexts 256,x' took 256 and dropped the rest.
@pytest.mark.parametrize("opt,value", [
    ("--shapes", "smoll"), ("--shapes", "smol,,llama"), ("--shapes", ""),
    ("--contexts", "256,x"), ("--contexts", "0"), ("--batches", "1,"),
    ("--threads", "-1"), ("--contexts", "99999999999"),
])
def test_bench_attn_rejects_bad_lists(kvarn_bin, opt, value):
    argv = [bench_bin("bench_attn"), "--formats", "int8"] + ATTN_QUICK + [opt, value]
    r = run(argv)
    assert r.returncode == 2, (opt, value, r.stdout, r.stderr)
    assert f"bench_attn: {opt}: " in r.stderr, r.stderr
    assert not any(line.startswith(("smol ", "llama ")) for line in r.stdout.splitlines())


def test_bench_attn_runs_each_listed_shape(kvarn_bin):
    quick = [a for a in ATTN_QUICK]
    quick[quick.index("--shapes") + 1] = "llama,smol"
    r = run([bench_bin("bench_attn"), "--formats", "int8"] + quick)
    assert r.returncode == 0, r.stderr
    shapes = [line.split()[0] for line in r.stdout.splitlines()
              if line.startswith(("smol ", "llama "))]
    assert sorted(set(shapes)) == ["llama", "smol"], r.stdout


def test_bench_attn_products(kvarn_bin):
    """--products: a row for each library after the formats, each measured
    (us/call > 0) or saying why not (not built in, or no kernel on this
    CPU); without --queries >= 2 it is refused, before any row."""
    r = run([bench_bin("bench_attn"), "--formats", "int8", "--queries", "8", "--products"]
            + ATTN_QUICK)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith("smol ")]
    names = [row[4] for row in rows]
    assert names == ["fp16", "int8", "prod:onednn-bf16", "prod:onednn-int8",
                     "prod:libxsmm-bf16", "prod:libxsmm-int8"], r.stdout
    for row in rows[2:]:
        assert row[5] == "not" or float(row[5]) > 0, row
    r = run([bench_bin("bench_attn"), "--formats", "int8", "--products"] + ATTN_QUICK)
    assert r.returncode == 2 and "bench_attn: --products" in r.stderr, (r.stdout, r.stderr)
    assert not any(line.startswith("smol ") for line in r.stdout.splitlines())


def test_model_not_a_regular_file(kvarn_bin, tmp_path):
    """A FIFO as -m used to block the open forever (no writer); a directory
    or a FIFO is refused before anything opens it."""
    import os
    fifo = tmp_path / "model.fifo"
    os.mkfifo(fifo)
    for path in (str(fifo), str(tmp_path)):
        for cmd in (["generate", "-p", "hi"], ["eval", "-f", "/dev/null"], ["passkey"], ["inspect"]):
            r = run([kvarn_bin, cmd[0], "-m", path] + cmd[1:], timeout=60)
            assert r.returncode == 1, (cmd, path, r.stderr)
            assert "is not a regular file" in r.stderr


def test_failed_stdout_write_is_an_error(kvarn_bin, model_path):
    """A report written to a full device is lost: exit 1 with a message, not
    0 (it used to exit 0)."""
    import os
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    with open("/dev/full", "w") as full:
        for args in (["--help"], ["inspect", "-m", model_path, "--budget", "1GiB"]):
            r = subprocess.run([kvarn_bin] + args, stdout=full, stderr=subprocess.PIPE,
                               text=True, timeout=600)
            assert r.returncode == 1, (args, r.stderr)
            assert "error writing standard output" in r.stderr


def test_tail_page_tokens_must_divide_the_tile(kvarn_bin, model_path):
    """--tail-page-tokens T that does not divide a chosen KVarN format's tile
    is a usage error (exit 2, before any output); it used to fail later as
    'invalid argument' with exit 1 after the table header."""
    for cmd in (["inspect", "-m", model_path], ["eval", "-m", model_path, "-f", "/dev/null"]):
        r = run([kvarn_bin] + cmd + ["--kv-cache-dtype", "kvarn_k4v2_g128", "--tail-page-tokens", "5"])
        assert r.returncode == 2, (cmd, r.stderr)
        assert "must divide the tile" in r.stderr and r.stdout == ""
    # a divisor, and a T of at least G (whole tail pages), are accepted
    for t in ("16", "128", "200"):
        r = run([kvarn_bin, "inspect", "-m", model_path, "--kv-cache-dtype", "kvarn_k4v2_g128",
                 "--tail-page-tokens", t])
        assert r.returncode == 0, (t, r.stderr)


def test_bad_weights_env_is_named(kvarn_bin, model_path):
    """An unknown KVARN_WEIGHTS fails the load; the message names the
    variable (it said only 'invalid argument')."""
    import os
    env = dict(os.environ, KVARN_WEIGHTS="bogus")
    r = run([kvarn_bin, "generate", "-m", model_path, "-p", "hi", "-n", "1"], env=env)
    assert r.returncode == 1 and "KVARN_WEIGHTS='bogus'" in r.stderr


def test_eval_says_what_it_lowered(kvarn_bin, model_path, tmp_path):
    """--decode-tokens beyond --ctx - 1 and a --ctx beyond the text are
    lowered with a notice (the chunk-fed measurement of --ctx 128 with the
    default 320 decode tokens covered 1 position, silently)."""
    text = tmp_path / "short.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession "
                    "of a good fortune, must be in want of a wife. " * 3)
    r = run([kvarn_bin, "eval", "-m", model_path, "-f", str(text), "--ctx", "24", "--chunk", "8",
             "--decode-tokens", "100", "--kv-cache-dtype", "int8"])
    assert r.returncode == 0, r.stderr
    assert "--decode-tokens 100 lowered to 23" in r.stderr
    r = run([kvarn_bin, "eval", "-m", model_path, "-f", str(text), "--ctx", "5000", "--chunk", "8",
             "--decode-tokens", "2", "--kv-cache-dtype", "int8"])
    assert r.returncode == 0, r.stderr
    assert "--ctx lowered to" in r.stderr


# ---- GGUF metadata the runner refuses: the key and its value named -------
# (fresh-user trial: llama.attention.head_count_kv = 0 said "give -m MODEL"
# in inspect; other bad or missing keys said only "malformed or truncated").
# Each file is a small llama GGUF written with the gguf package: the keys
# below (SmolLM2-135M's head counts, smaller widths) and a token_embd of
# 32 x 64, with one key changed, removed or retyped.

GOOD_KEYS = {
    "llama.block_count": ("uint32", 2),
    "llama.embedding_length": ("uint32", 64),
    "llama.attention.head_count": ("uint32", 9),
    "llama.attention.head_count_kv": ("uint32", 3),
    "llama.attention.key_length": ("uint32", 64),
    "llama.feed_forward_length": ("uint32", 128),
    "llama.context_length": ("uint32", 256),
    "llama.rope.freq_base": ("float32", 10000.0),
}


def write_llama_gguf(path, keys, arch="llama", embd=(32, 64)):
    """A GGUF of arch with keys {name: (type, value)} and, unless embd is
    None, a token_embd.weight of embd = (vocab, hidden) rows (numpy order)."""
    import gguf
    import numpy as np
    w = gguf.GGUFWriter(str(path), arch)
    for name, (kind, value) in keys.items():
        getattr(w, "add_" + kind)(name, value)
    if embd is not None:
        w.add_tensor("token_embd.weight", np.zeros(embd, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


BAD_METADATA = [
    # (id, change to GOOD_KEYS: {key: (type, value) or None to drop}, expected text)
    ("kv_heads_0", {"llama.attention.head_count_kv": ("uint32", 0)},
     "GGUF key llama.attention.head_count_kv = 0: must be >= 1 and divide head_count 9"),
    ("kv_heads_4", {"llama.attention.head_count_kv": ("uint32", 4)},
     "GGUF key llama.attention.head_count_kv = 4: must be >= 1 and divide head_count 9"),
    ("no_block_count", {"llama.block_count": None}, "GGUF key llama.block_count is missing"),
    ("emb_string", {"llama.embedding_length": ("string", "64")},
     "GGUF key llama.embedding_length has type string: expected an integer"),
    ("ctx_0", {"llama.context_length": ("uint32", 0)},
     "GGUF key llama.context_length = 0: must be from 1 to 2147483647"),
    ("ffn_huge", {"llama.feed_forward_length": ("uint64", 2 ** 32 + 5)},
     "GGUF key llama.feed_forward_length = 4294967301: must be from 1 to 2147483647"),
    ("heads_negative", {"llama.attention.head_count": ("int32", -3)},
     "GGUF key llama.attention.head_count = -3: must be from 1 to 2147483647"),
    ("key_length_odd", {"llama.attention.key_length": ("uint32", 63)},
     "GGUF key llama.attention.key_length = 63: must be even and >= 2"),
    ("freq_base_0", {"llama.rope.freq_base": ("float32", 0.0)},
     "GGUF key llama.rope.freq_base = 0: must be a finite number > 0"),
    ("freq_base_string", {"llama.rope.freq_base": ("string", "1e4")},
     "GGUF key llama.rope.freq_base has type string: expected a number"),
    # beyond the cache's limits (kvarn/cache.h): once an empty table and
    # "cache format 'int8': invalid argument" per format
    ("layers_5000", {"llama.block_count": ("uint32", 5000)},
     "GGUF key llama.block_count = 5000: more layers than a cache holds (at most 4096)"),
    ("kv_heads_4097", {"llama.attention.head_count": ("uint32", 8194),
                       "llama.attention.head_count_kv": ("uint32", 4097)},
     "GGUF key llama.attention.head_count_kv = 4097: more KV heads than a cache holds (at most 4096)"),
    ("heads_4097_no_kv", {"llama.attention.head_count": ("uint32", 4097),
                          "llama.attention.head_count_kv": None},
     "GGUF key llama.attention.head_count = 4097: more KV heads than a cache holds (at most 4096)"),
]


@pytest.mark.parametrize("change,expected", [c[1:] for c in BAD_METADATA],
                         ids=[c[0] for c in BAD_METADATA])
def test_bad_gguf_metadata_names_the_key(kvarn_bin, tmp_path, change, expected):
    keys = dict(GOOD_KEYS)
    for k, v in change.items():
        if v is None:
            del keys[k]
        else:
            keys[k] = v
    path = tmp_path / "bad.gguf"
    write_llama_gguf(path, keys)
    text = tmp_path / "text.txt"
    text.write_text("It is a truth universally acknowledged.")
    for cmd in (["generate", "-p", "hi"], ["eval", "-f", str(text)], ["passkey"], ["inspect"]):
        r = run([kvarn_bin, cmd[0], "-m", str(path)] + cmd[1:], timeout=60)
        assert r.returncode == 1, (cmd, r.stderr)
        assert expected in r.stderr, (cmd, r.stderr)
        assert "give -m" not in r.stderr and "malformed or truncated" not in r.stderr


def test_not_llama_or_no_embedding_is_named(kvarn_bin, tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_llama_gguf(path, {}, arch="gpt2")
    for cmd in (["generate", "-p", "hi"], ["inspect"]):
        r = run([kvarn_bin, cmd[0], "-m", str(path)] + cmd[1:])
        assert r.returncode == 1 and "GGUF key general.architecture = 'gpt2'" in r.stderr, r.stderr
    path = tmp_path / "noembd.gguf"
    write_llama_gguf(path, GOOD_KEYS, embd=None)
    r = run([kvarn_bin, "generate", "-m", str(path), "-p", "hi"])
    assert r.returncode == 1 and "GGUF tensor token_embd.weight is missing" in r.stderr, r.stderr
    path = tmp_path / "wideembd.gguf"
    write_llama_gguf(path, GOOD_KEYS, embd=(32, 65))
    r = run([kvarn_bin, "generate", "-m", str(path), "-p", "hi"])
    assert r.returncode == 1, r.stderr
    assert "GGUF tensor token_embd.weight has shape [65, 32]: expected" in r.stderr, r.stderr


# ---- KVARN_SIMD naming no level (fresh-user trial: silently ignored) -----
# The library ignores it (runs at the CPU's level, prints nothing); the
# kvarn command and the benchmarks that run kernels refuse it: exit 2, one
# line naming the accepted values, before any work.

def test_bad_simd_env_is_a_usage_error(kvarn_bin, model_path):
    import os
    for bad in ("bogus", "AVX2", "sse4"):
        env = dict(os.environ, KVARN_SIMD=bad)
        argvs = [
            [kvarn_bin, "generate", "-m", model_path, "-p", "hi", "-n", "1"],
            [kvarn_bin, "eval", "-m", model_path, "-f", "absent.txt"],
            [kvarn_bin, "passkey", "-m", model_path],
            [kvarn_bin, "inspect", "--layers", "1", "--kv-heads", "1", "--head-dim", "64"],
            [bench_bin("bench_attn"), "--formats", "int8"] + ATTN_QUICK,
            [bench_bin("bench_codec"), "--format", "int8"] + CODEC_QUICK,
            [bench_bin("bench_decode"), "-m", "absent.gguf"],
            [bench_bin("bench_matmul"), "--m", "1"],
        ]
        for argv in argvs:
            r = run(argv, env=env, timeout=120)
            assert r.returncode == 2, (argv[:2], bad, r.stderr)
            assert f"KVARN_SIMD='{bad}' is not a SIMD level" in r.stderr, (argv[:2], r.stderr)
            assert "scalar|avx2|avx512" in r.stderr and r.stdout == "", (argv[:2], r.stdout)
    # the accepted values and an empty one run as before; help still prints
    for good in ("scalar", "avx2", "avx512", ""):
        env = dict(os.environ, KVARN_SIMD=good)
        r = run([kvarn_bin, "inspect", "--layers", "1", "--kv-heads", "1", "--head-dim", "64"], env=env)
        assert r.returncode == 0, (good, r.stderr)
    r = run([kvarn_bin, "generate", "--help"], env=dict(os.environ, KVARN_SIMD="bogus"))
    assert r.returncode == 0 and r.stdout.startswith("usage: kvarn generate")


def short_text(tmp_path):
    """A short text file (8 sentences) for eval runs that only check options."""
    text = tmp_path / "text.txt"
    text.write_text("It is a truth universally acknowledged. " * 8)
    return text


# ---- --dump-layers (fresh-user trial: ignored without --dump-kv, and a
# count beyond the model's layers silently cut to all) ---------------------

def test_dump_layers_needs_dump_kv(kvarn_bin, model_path, tmp_path):
    text = short_text(tmp_path)
    r = run([kvarn_bin, "eval", "-m", model_path, "-f", str(text), "--ctx", "32",
             "--kv-cache-dtype", "int8", "--dump-layers", "2"])
    assert r.returncode == 2, r.stderr
    assert "--dump-layers 2 needs --dump-kv FILE" in r.stderr and r.stdout == ""


def test_dump_layers_beyond_the_model(kvarn_bin, model_path, tmp_path):
    # SmolLM2-135M has 30 layers: 31 and 999 are refused once it is loaded,
    # naming the count; nothing is dumped. 30 (all) is accepted.
    text = short_text(tmp_path)
    dump = tmp_path / "kv.bin"
    for n in ("31", "999"):
        r = run([kvarn_bin, "eval", "-m", model_path, "-f", str(text), "--ctx", "32",
                 "--kv-cache-dtype", "int8", "--dump-kv", str(dump), "--dump-layers", n])
        assert r.returncode == 2, (n, r.stderr)
        assert f"--dump-layers {n} is more than the model's 30 layers" in r.stderr, r.stderr
        assert r.stdout == "" and not dump.exists()
    r = run([kvarn_bin, "eval", "-m", model_path, "-f", str(text), "--ctx", "32", "--decode-tokens", "4",
             "--kv-cache-dtype", "int8", "--dump-kv", str(dump), "--dump-layers", "30"])
    assert r.returncode == 0, r.stderr
    assert int.from_bytes(dump.read_bytes()[12:16], "little") == 30  # n_layers (docs/kv-dump.md)


# ---- cosmetics of the fresh-user trial -----------------------------------

def test_chat_on_empty_stdin_says_nothing_to_generate(kvarn_bin, model_path):
    # it printed "prompt 0.0 tok/s, generation 0.0 tok/s" and a 0-token cache
    for stdin in ("", "\n\n"):
        r = run([kvarn_bin, "generate", "-m", model_path, "--chat", "--kv-cache-dtype", "int8"],
                input=stdin)
        assert r.returncode == 0, r.stderr
        assert "[int8] nothing to generate: no message on standard input" in r.stderr
        assert "tok/s" not in r.stderr and r.stdout == ""


def test_eval_decode_tokens_0_says_skipped(kvarn_bin, model_path, tmp_path):
    # the reference's "dec tok/s" said 0.0 when nothing was decoded
    text = short_text(tmp_path)
    r = run([kvarn_bin, "eval", "-m", model_path, "-f", str(text), "--ctx", "32",
             "--decode-tokens", "0", "--kv-cache-dtype", "int8"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "decode skipped (--decode-tokens 0" in lines[0]
    rows = [line.split() for line in lines if line.startswith(("fp16 (reference)", "int8 "))]
    assert len(rows) == 2
    for row in rows:
        assert row[-2:] == ["skipped", "-"], row


def test_passkey_progress_is_evenly_spaced(kvarn_bin, model_path):
    # 1 length x 2 depths x 3 trials x (fp16 + int8) = 12 prompts; off a
    # terminal a line per ceil(12 / 10) = 2 of them: 2, 4, ..., 12 (it
    # printed 1..6, then 8..12: 10 * done / total skipped 7)
    r = run([kvarn_bin, "passkey", "-m", model_path, "--lengths", "128", "--depths", "0,100",
             "--trials", "3", "--kv-cache-dtype", "int8"])
    assert r.returncode == 0, r.stderr
    counts = [line.split(": ")[1] for line in r.stderr.splitlines()
              if line.startswith("kvarn passkey: ") and "/" in line]
    assert counts == [f"{n}/12" for n in range(2, 13, 2)], r.stderr


def help_option_lines(text):
    """The option lines of a --help: after the synopsis's blank line, lines
    that start with '-' or are indented, up to the notes."""
    body = text.split("\n\n", 1)[1]
    out = []
    for line in body.splitlines():
        if not line.startswith(("-", " ")):
            break
        out.append(line)
    return out


def test_help_columns_and_synopsis(kvarn_bin):
    # "--tail-page-tokens TKVarN:": a synopsis as wide as the 18-column
    # first column ran into its text; eval's synopsis lacked the option.
    for cmd in ("generate", "eval", "passkey", "inspect"):
        text = run([kvarn_bin, cmd, "--help"]).stdout
        synopsis = text.split("\n\n", 1)[0]
        lines = help_option_lines(text)
        assert lines, cmd
        for line in lines:
            if line.startswith("-"):
                # the synopsis alone, or a space at the end of the column
                assert len(line.split()) <= 2 or line[17] == " ", (cmd, line)
                assert line.split()[0] in synopsis, (cmd, line.split()[0])
        assert "TKVarN" not in text


# ---- the benchmarks' own help (fresh-user trial: bench_decode --help and
# bench_matmul --help silently ran the whole benchmark, a trailing option
# without its value was dropped; bench_attn / bench_codec --help exited 2)

def test_bench_help_and_missing_values(kvarn_bin):
    # each usage line names the program as its messages do, by its own name
    # (bench_attn and bench_codec printed argv[0], e.g. "usage:
    # /home/.../build/bench_attn", the others their name)
    for name in ("bench_attn", "bench_capacity", "bench_codec", "bench_decode", "bench_matmul"):
        for flag in ("--help", "-h"):
            r = run([bench_bin(name), flag], timeout=60)
            assert r.returncode == 0, (name, flag, r.stderr)
            assert r.stdout.startswith(f"usage: {name} ["), (name, r.stdout)
    # and so does the usage printed after a usage error
    for name, argv in (("bench_attn", ["--bogus"]), ("bench_codec", ["--bogus"]),
                       ("bench_decode", ["--bogus"]), ("bench_matmul", ["--bogus"])):
        r = run([bench_bin(name)] + argv, timeout=60)
        assert r.returncode == 2, (name, r.stderr)
        usage = [line for line in r.stderr.splitlines() if line.startswith("usage: ")]
        assert usage and usage[0].startswith(f"usage: {name} ["), (name, r.stderr)
    # an option given without its value is a usage error, before any work
    for argv in ([bench_bin("bench_decode"), "--ctx"],
                 [bench_bin("bench_decode"), "-m", "absent.gguf", "--repeat"],
                 [bench_bin("bench_matmul"), "--repeat"]):
        r = run(argv, timeout=60)
        assert r.returncode == 2, (argv, r.stderr)
        assert "needs a value" in r.stderr and r.stdout == "", (argv, r.stdout, r.stderr)


def test_bench_vs_llamacpp_help():
    import os
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench_vs_llamacpp.sh")
    r = run(["bash", script, "-h"], timeout=60)
    assert r.returncode == 0, r.stderr
    assert "bench_vs_llamacpp.sh" in r.stdout
    # its header only, no code
    assert "set -euo pipefail" not in r.stdout and "MODEL=" not in r.stdout, r.stdout
    r = run(["bash", script, "-Z"], timeout=60)
    assert r.returncode == 2 and r.stdout == "", r.stdout


# ---- eval columns that measure no quantized K/V (fresh-user trial: --ctx
# 512 with the default 320 decoded tokens printed the chunk-fed KLD columns
# of the KVarN formats as 0, silently) --------------------------------------
# tools/eval_coverage.h: a chunk attends to its own K/V exactly and to the
# history before its start as the cache holds it; a KVarN cache (tile G,
# sink S) holds floor(n / G) * G - S of n committed tokens quantized, a
# per-token cache all n. A column warns when none of its scored positions
# sees a quantized token.

def eval_warnings(stderr):
    return [line for line in stderr.splitlines() if line.startswith("kvarn eval: warning:")]


def test_eval_warns_chunk_fed_positions_in_fp16(kvarn_bin, model_path, austen_path):
    # --ctx 512, 320 decoded: chunk-fed tokens [0, 192) in chunks starting at
    # 0 and 128. kvarn_k4v2_g128 (G = S = 128) quantizes its first tile
    # [128, 256) at the commit after token 255: the history of the chunk at
    # 128 is the sink alone. int8 holds those 128 tokens in int8: measured.
    # The decoded positions (up to 510) see tiles [128, 384): measured.
    r = run([kvarn_bin, "eval", "-m", model_path, "-f", austen_path, "--ctx", "512",
             "--kv-cache-dtype", "kvarn_k4v2_g128,int8"])
    assert r.returncode == 0, r.stderr
    warns = eval_warnings(r.stderr)
    assert len(warns) == 1, r.stderr
    w = warns[0]
    assert "chunk-fed columns" in w and "of kvarn_k4v2_g128 measure no quantized K/V" in w, w
    assert "int8" not in w and "starts at token 128" in w, w
    # A chunk must start at c >= 256 (the first quantized tile's end) with a
    # scored chunk-fed position at or after it: ctx - 320 >= 257, i.e. ctx
    # >= 577; or at ctx 512, decode at most 512 - 257 = 255; or a sink below
    # the 128 tokens the chunk at 128 sees (S <= 127). No chunk size helps
    # (positions below 192 never start a chunk at >= 256).
    assert ("To measure them: --ctx 577 or more, or --decode-tokens 255 or less, "
            "or --sink-tokens 127 or less.") in w, w
    assert "--chunk" not in w.split("To measure them")[1], w
    # what it proposes is enough: 255 decoded tokens, no warning
    r = run([kvarn_bin, "eval", "-m", model_path, "-f", austen_path, "--ctx", "512",
             "--decode-tokens", "255", "--kv-cache-dtype", "kvarn_k4v2_g128"])
    assert r.returncode == 0, r.stderr
    assert eval_warnings(r.stderr) == [], r.stderr


def test_eval_warns_decoded_positions_in_fp16(kvarn_bin, model_path, austen_path):
    # --ctx 200: the last decoded position (198) sees tokens [0, 128) as the
    # sink and [128, 199) as the fp16 tail: nothing quantized for G = 128, S
    # = 128 (it needs ctx - 2 >= 256: --ctx 258), while the g64 preset
    # (S = 64) has tile [64, 128) quantized from token 128 on. The chunk-fed
    # positions [0, 100) are one chunk: both formats warn there.
    r = run([kvarn_bin, "eval", "-m", model_path, "-f", austen_path, "--ctx", "200",
             "--decode-tokens", "100", "--kv-cache-dtype", "kvarn_k4v2_g128,kvarn_k4v2_g64"])
    assert r.returncode == 0, r.stderr
    warns = eval_warnings(r.stderr)
    assert len(warns) == 2, r.stderr
    chunk, dec = warns
    assert "chunk-fed columns" in chunk and "of kvarn_k4v2_g128, kvarn_k4v2_g64" in chunk, chunk
    assert "starts at token 0 (one chunk" in chunk, chunk
    assert "decoded columns" in dec and "of kvarn_k4v2_g128 measure no quantized" in dec, dec
    assert "To measure them: --ctx 258 or more, or --sink-tokens 127 or less." in dec, dec


def test_eval_warns_one_chunk_and_no_decoded_position(kvarn_bin, model_path, tmp_path):
    # --ctx 32 (--chunk 128 lowered to 32), 8 decoded: the chunk-fed
    # positions [0, 24) are one chunk, which attends to nothing stored.
    # int8 needs a chunk start >= 1 with a scored position after it: --chunk
    # 23 or less (the chunk at 23 holds position 23), or --ctx 128 + 1 + 8.
    text = short_text(tmp_path)
    r = run([kvarn_bin, "eval", "-m", model_path, "-f", str(text), "--ctx", "32",
             "--decode-tokens", "8", "--kv-cache-dtype", "int8"])
    assert r.returncode == 0, r.stderr
    warns = eval_warnings(r.stderr)
    assert len(warns) == 1 and "of int8 measure no quantized K/V" in warns[0], r.stderr
    assert "To measure them: --ctx 137 or more, or --chunk 23 or less." in warns[0], warns[0]
    r = run([kvarn_bin, "eval", "-m", model_path, "-f", str(text), "--ctx", "32",
             "--decode-tokens", "8", "--chunk", "23", "--kv-cache-dtype", "int8"])
    assert r.returncode == 0 and eval_warnings(r.stderr) == [], r.stderr
    # one decoded token: no decoded position is scored (its next token is
    # past the window): the dec columns read '-', and it says so
    r = run([kvarn_bin, "eval", "-m", model_path, "-f", str(text), "--ctx", "32",
             "--decode-tokens", "1", "--chunk", "8", "--kv-cache-dtype", "int8"])
    assert r.returncode == 0, r.stderr
    warns = eval_warnings(r.stderr)
    assert len(warns) == 1 and "--decode-tokens 1 scores no decoded position" in warns[0], r.stderr
    assert "use --decode-tokens 2 or more" in warns[0]


# ---- eval's table: distinct headings, no negative zero -------------------

def test_eval_table_headings_and_zero_delta(kvarn_bin, model_path, tmp_path):
    # Two columns were both headed "x fp16" (capacity, decode speed), and
    # the fp16 row's dPPL read -0.0000 (on this text, --chunk 16
    # --decode-tokens 20, on the machine of the fix): its perplexity summed
    # the chunk-fed and decoded NLLs apart, the reference's in one sum. The
    # same logits summed in the same order give the same perplexity.
    text = short_text(tmp_path)
    args = [kvarn_bin, "eval", "-m", model_path, "-f", str(text), "--ctx", "64",
            "--chunk", "16", "--decode-tokens", "20", "--kv-cache-dtype", "fp16,int8"]
    r = run(args)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    header = lines[1]
    assert "cap x fp16" in header and "tok/s x fp16" in header, header
    assert len(re.findall(r"(?<![a-z/]) x fp16", header)) == 0, header  # no bare "x fp16"
    assert lines[2].startswith("fp16 (reference)"), lines
    rows = {line.split()[0]: line for line in lines[3:] if line.strip()}
    assert set(rows) == {"fp16", "int8"}, rows
    # each ratio ends under the end of its heading
    for heading in ("cap x fp16", "tok/s x fp16"):
        end = header.index(heading) + len(heading)
        for row in [lines[2]] + list(rows.values()):
            assert row[end - 1] == "x" and (len(row) == end or row[end] == " "), (heading, row)
    # ... PPL, dPPL, passkey, dec tok/s, tok/s x fp16
    dppl = {name: row.split()[-4] for name, row in rows.items()}
    assert dppl["fp16"] == "+0.0000", rows["fp16"]
    assert re.fullmatch(r"[+-]\d+\.\d{4}", dppl["int8"]), rows["int8"]
    rep = json.loads(run(args + ["--json"]).stdout)
    fp16 = [f for f in rep["formats"] if f["format"] == "fp16"][0]
    assert fp16["ppl_delta"] == 0.0 and fp16["ppl"] == rep["reference"]["ppl"], fp16


def test_help_fits_80_columns(kvarn_bin):
    # generate's synopsis ran to 87 columns, the top-level format list to
    # 200: every --help line must fit a terminal of 80.
    for cmd in ([], ["generate"], ["eval"], ["passkey"], ["inspect"]):
        r = run([kvarn_bin] + cmd + ["--help"])
        assert r.returncode == 0, (cmd, r.stderr)
        wide = [line for line in r.stdout.splitlines() if len(line) > 80]
        assert wide == [], (cmd, wide)


# ---- GGUF tensors the runner refuses: the tensor and what is wrong named --
# (fresh-user trial: a missing or misshapen blk.N.* tensor said only
# "malformed or truncated"). A whole small llama (GOOD_KEYS: 2 layers,
# embedding 64, 9 heads, 3 KV heads of 64, ffn 128; 32 tokens) written with
# the gguf package, numpy shape (out, in) = GGUF ne [in, out]; one tensor
# dropped, reshaped or retyped.

def llama_tensors():
    import numpy as np
    E, Q, KV, F, V = 64, 9 * 64, 3 * 64, 128, 32
    t = {"token_embd.weight": (V, E), "output_norm.weight": (E,)}
    for l in range(2):
        t.update({f"blk.{l}.attn_norm.weight": (E,), f"blk.{l}.attn_q.weight": (Q, E),
                  f"blk.{l}.attn_k.weight": (KV, E), f"blk.{l}.attn_v.weight": (KV, E),
                  f"blk.{l}.attn_output.weight": (E, Q), f"blk.{l}.ffn_norm.weight": (E,),
                  f"blk.{l}.ffn_gate.weight": (F, E), f"blk.{l}.ffn_up.weight": (F, E),
                  f"blk.{l}.ffn_down.weight": (E, F)})
    return {name: np.zeros(shape, dtype=np.float32) for name, shape in t.items()}


def write_llama_model(path, tensors):
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (kind, value) in GOOD_KEYS.items():
        getattr(w, "add_" + kind)(name, value)
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def bad_tensor_cases():
    import numpy as np
    f32 = np.float32
    return [
        # (id, {name: array or None to drop}, expected text)
        ("ffn_down_missing", {"blk.1.ffn_down.weight": None},
         "GGUF tensor blk.1.ffn_down.weight is missing"),
        ("attn_k_rows", {"blk.0.attn_k.weight": np.zeros((190, 64), f32)},
         "GGUF tensor blk.0.attn_k.weight has shape [64, 190]: expected [64, 192] "
         "(embedding_length 64, head_count_kv 3 x head_dim 64)"),
        ("attn_output_transposed", {"blk.1.attn_output.weight": np.zeros((576, 64), f32)},
         "GGUF tensor blk.1.attn_output.weight has shape [64, 576]: expected [576, 64] "
         "(head_count 9 x head_dim 64, embedding_length 64)"),
        ("norm_as_matrix", {"blk.0.ffn_norm.weight": np.zeros((2, 64), f32)},
         "GGUF tensor blk.0.ffn_norm.weight has shape [64, 2]: expected [64] "
         "(embedding_length 64)"),
        ("ffn_up_missing_layer0", {"blk.0.ffn_up.weight": None},
         "GGUF tensor blk.0.ffn_up.weight is missing"),
    ]


@pytest.mark.parametrize("case", bad_tensor_cases(), ids=lambda c: c[0])
def test_bad_gguf_tensor_is_named(kvarn_bin, tmp_path, case):
    _, change, expected = case
    tensors = llama_tensors()
    for name, data in change.items():
        if data is None:
            del tensors[name]
        else:
            tensors[name] = data
    path = tmp_path / "bad.gguf"
    write_llama_model(path, tensors)
    text = short_text(tmp_path)
    for cmd in (["generate", "-p", "hi"], ["eval", "-f", str(text)], ["passkey"]):
        r = run([kvarn_bin, cmd[0], "-m", str(path)] + cmd[1:], timeout=60)
        assert r.returncode == 1, (cmd, r.stderr)
        assert expected in r.stderr, (cmd, r.stderr)
        assert "malformed or truncated" not in r.stderr, (cmd, r.stderr)


def test_gguf_tensor_types(kvarn_bin, tmp_path):
    import numpy as np
    # the whole model as written loads its tensors: it fails on the
    # tokenizer it lacks, after them
    path = tmp_path / "good.gguf"
    write_llama_model(path, llama_tensors())
    r = run([kvarn_bin, "generate", "-m", str(path), "-p", "hi"], timeout=60)
    assert r.returncode == 1 and "cannot build the tokenizer" in r.stderr, r.stderr
    # a type this reader does not serve (I32): refused at open, the tensor
    # and its type named beside the types served
    tensors = llama_tensors()
    tensors["blk.1.attn_v.weight"] = np.zeros((192, 64), dtype=np.int32)
    path = tmp_path / "i32.gguf"
    write_llama_model(path, tensors)
    r = run([kvarn_bin, "generate", "-m", str(path), "-p", "hi"], timeout=60)
    assert r.returncode == 1, r.stderr
    assert "tensor 'blk.1.attn_v.weight': type 26 (I32) is not supported" in r.stderr, r.stderr
    assert "supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1" in r.stderr, r.stderr


# ---- a tensor retyped in the header (fresh-user trial): blk.0.ffn_down
# Q4_1 -> F32 makes its data 6.4x longer, running over the tensors after it
# while staying inside the data section. `kvarn inspect` accepted the file
# and `kvarn generate` failed in the forward pass ("forward: non-finite
# input"); the GGUF reader now refuses it at open, naming both tensors.

def retype_tensor(model_path, name, new_type, old_type=3):
    """The model's bytes with tensor `name`'s type field (old_type, Q4_1 by
    default) set to new_type."""
    data = bytearray(open(model_path, "rb").read())
    key = len(name).to_bytes(8, "little") + name.encode()
    at = data.find(key)
    assert at > 0 and data.find(key, at + 1) < 0
    p = at + len(key)
    n_dims = int.from_bytes(data[p:p + 4], "little")
    p += 4 + 8 * n_dims
    assert int.from_bytes(data[p:p + 4], "little") == old_type
    data[p:p + 4] = new_type.to_bytes(4, "little")
    return bytes(data)


def test_retyped_tensor_overlapping_the_next_is_refused(kvarn_bin, model_path, tmp_path):
    bad = tmp_path / "retyped.gguf"
    bad.write_bytes(retype_tensor(model_path, "blk.0.ffn_down.weight", 0))  # F32
    expected = ("tensors 'blk.0.ffn_down.weight' (data bytes [30083328, 33622272)) and "
                "'blk.0.ffn_gate.weight' ([30636288, 31189248)) overlap")
    for cmd in (["inspect"], ["generate", "-p", "hi", "-n", "1"]):
        r = run([kvarn_bin, cmd[0], "-m", str(bad)] + cmd[1:], timeout=120)
        assert r.returncode == 1, (cmd, r.stderr)
        assert expected in r.stderr, (cmd, r.stderr)
        assert "non-finite" not in r.stderr and r.stdout == "", (cmd, r.stdout, r.stderr)
    # the file as published (its tensors back to back, no gaps) still loads
    r = run([kvarn_bin, "inspect", "-m", model_path, "--kv-cache-dtype", "int8"])
    assert r.returncode == 0, r.stderr



# ---- a tensor retyped in the header to a SMALLER type (tester): its data
# ends early, leaving a gap before the next tensor. It opened, `kvarn
# inspect` accepted it, and `kvarn generate` failed late ("forward:
# non-finite (NaN or Inf) input") or generated garbage. The reader now
# requires the packed layout ggml requires and names both tensors.

SHRINK_CASES = [
    # (tensor, old type, new type, expected message)
    ("blk.0.ffn_down.weight", 3, 2,  # Q4_1 -> Q4_0
     "tensors 'blk.0.ffn_down.weight' (data bytes [30083328, 30580992)) and "
     "'blk.0.ffn_gate.weight' ([30636288, 31189248)) leave 55296 bytes unaccounted for: "
     "a type or shape in the header does not match the data (retyped to a smaller type?)"),
    ("blk.0.attn_norm.weight", 0, 1,  # F32 -> F16
     "tensors 'blk.0.attn_norm.weight' (data bytes [30081024, 30082176)) and "
     "'blk.0.ffn_down.weight' ([30083328, 30636288)) leave 1152 bytes unaccounted for"),
    ("token_embd.weight", 8, 2,  # Q8_0 -> Q4_0
     "tensors 'token_embd.weight' (data bytes [0, 15925248)) and "
     "'blk.0.attn_norm.weight' ([30081024, 30083328)) leave 14155776 bytes unaccounted for"),
]


@pytest.mark.parametrize("case", SHRINK_CASES, ids=lambda c: c[0])
def test_retyped_tensor_to_a_smaller_type_is_refused(kvarn_bin, model_path, tmp_path, case):
    name, old_type, new_type, expected = case
    bad = tmp_path / "retyped.gguf"
    bad.write_bytes(retype_tensor(model_path, name, new_type, old_type))
    for cmd in (["inspect"], ["generate", "-p", "hi", "-n", "1"]):
        r = run([kvarn_bin, cmd[0], "-m", str(bad)] + cmd[1:], timeout=120)
        assert r.returncode == 1, (cmd, r.stderr)
        assert expected in r.stderr, (cmd, r.stderr)
        assert "non-finite" not in r.stderr and r.stdout == "", (cmd, r.stdout, r.stderr)


def test_gguf_tensors_out_of_data_order_still_load(kvarn_bin, tmp_path):
    # gguf-py lists the infos in data order; the same file with the data
    # laid out in reverse (each info's offset patched, infos kept in place)
    # is still packed and opens: the layout is checked in offset order
    import gguf
    path = tmp_path / "good.gguf"
    write_llama_model(path, llama_tensors())
    rd = gguf.GGUFReader(str(path))
    data = bytearray(path.read_bytes())
    ts = list(rd.tensors)
    base = min(t.data_offset for t in ts)
    assert all(t.n_bytes % 32 == 0 for t in ts)  # no padding between them
    blobs = {t.name: bytes(data[t.data_offset:t.data_offset + t.n_bytes]) for t in ts}
    off = 0
    for t in reversed(ts):
        data[base + off:base + off + t.n_bytes] = blobs[t.name]
        pos = t.field.offset + sum(p.nbytes for p in t.field.parts[:-1])
        assert int.from_bytes(data[pos:pos + 8], "little") == t.data_offset - base
        data[pos:pos + 8] = off.to_bytes(8, "little")
        off += t.n_bytes
    path.write_bytes(bytes(data))
    del rd
    moved = gguf.GGUFReader(str(path))
    assert [t.name for t in moved.tensors] == [t.name for t in ts]
    assert moved.tensors[0].data_offset > moved.tensors[-1].data_offset
    r = run([kvarn_bin, "generate", "-m", str(path), "-p", "hi"], timeout=60)
    assert r.returncode == 1 and "cannot build the tokenizer" in r.stderr, r.stderr


# ---- names from the file are quoted with non-printable bytes escaped
# (tester: a tensor name with "\n" split the one-line error, one with ESC
# sent terminal escapes). blk.0.ffn_gate.weight renamed (same length) and
# moved 32 bytes back, so that it overlaps ffn_down.

@pytest.mark.parametrize("new_name, shown", [
    (b"blk.0.ffn\ngate.weight", r"'blk.0.ffn\ngate.weight'"),
    (b"blk.0.ffn\x1b[31m.weight", r"'blk.0.ffn\x1b[31m.weight'"),
], ids=["newline", "esc"])
def test_tensor_names_in_messages_are_escaped(kvarn_bin, model_path, tmp_path, new_name, shown):
    name = b"blk.0.ffn_gate.weight"
    assert len(new_name) == len(name)
    data = bytearray(open(model_path, "rb").read())
    key = len(name).to_bytes(8, "little") + name
    at = data.find(key)
    assert at > 0 and data.find(key, at + 1) < 0
    data[at + 8:at + 8 + len(name)] = new_name
    p = at + len(key)
    n_dims = int.from_bytes(data[p:p + 4], "little")
    p += 4 + 8 * n_dims + 4
    off = int.from_bytes(data[p:p + 8], "little")
    data[p:p + 8] = (off - 32).to_bytes(8, "little")
    bad = tmp_path / "named.gguf"
    bad.write_bytes(bytes(data))
    r = run([kvarn_bin, "inspect", "-m", str(bad)], timeout=120)
    assert r.returncode == 1, r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert "\x1b" not in r.stderr
    assert "and " + shown + " ([30636256, 31189216)) overlap" in r.stderr, r.stderr


# ---- KVarN-only options with no KVarN format (fresh-user trial:
# --sink-tokens was taken silently by int8, where it does nothing: the
# cache ignores sink_tokens for per-token formats, and so does inspect) ---

def sink_warnings(stderr, cmd):
    return [line for line in stderr.splitlines() if line.startswith(f"kvarn {cmd}: warning: --")]


def test_kvarn_only_options_warn_without_a_kvarn_format(kvarn_bin, model_path, tmp_path):
    shape = ["--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--budget", "1GiB"]
    plain = run([kvarn_bin, "inspect", "--kv-cache-dtype", "int8,fp8"] + shape)
    assert plain.returncode == 0 and plain.stderr == "", plain.stderr
    r = run([kvarn_bin, "inspect", "--kv-cache-dtype", "int8,fp8", "--sink-tokens", "16"] + shape)
    assert r.returncode == 0, r.stderr
    assert sink_warnings(r.stderr, "inspect") == [
        "kvarn inspect: warning: --sink-tokens 16 does nothing for int8, fp8_e4m3: only KVarN "
        "formats (kvarn_*) keep a staged sink"], r.stderr
    # the numbers are those without it
    table = [line for line in r.stdout.splitlines() if not line.startswith("KVarN:")]
    assert table == plain.stdout.splitlines(), (r.stdout, plain.stdout)
    r = run([kvarn_bin, "inspect", "--kv-cache-dtype", "int8", "--tail-page-tokens", "16"] + shape)
    assert r.returncode == 0, r.stderr
    assert sink_warnings(r.stderr, "inspect") == [
        "kvarn inspect: warning: --tail-page-tokens 16 does nothing for int8: only KVarN "
        "formats (kvarn_*) hold their tail in pages"], r.stderr
    # with a KVarN format in the list the option does something: no warning
    # (nor for the default sink, or tail pages of 0)
    for extra in (["--kv-cache-dtype", "int8,kvarn_k4v2_g128", "--sink-tokens", "16"],
                  ["--kv-cache-dtype", "all", "--sink-tokens", "0", "--tail-page-tokens", "16"],
                  ["--kv-cache-dtype", "int8", "--tail-page-tokens", "0"]):
        r = run([kvarn_bin, "inspect"] + extra + shape)
        assert r.returncode == 0 and r.stderr == "", (extra, r.stderr)
    # passkey and eval say the same, eval's JSON report too
    r = run([kvarn_bin, "passkey", "-m", model_path, "--kv-cache-dtype", "int8", "--lengths", "64",
             "--depths", "0", "--sink-tokens", "4"])
    assert r.returncode == 0, r.stderr
    assert sink_warnings(r.stderr, "passkey") == [
        "kvarn passkey: warning: --sink-tokens 4 does nothing for int8: only KVarN formats "
        "(kvarn_*) keep a staged sink"], r.stderr
    text = short_text(tmp_path)
    r = run([kvarn_bin, "eval", "-m", model_path, "-f", str(text), "--ctx", "32", "--chunk", "8",
             "--decode-tokens", "4", "--kv-cache-dtype", "int8", "--sink-tokens", "4", "--json"])
    assert r.returncode == 0, r.stderr
    w = sink_warnings(r.stderr, "eval")
    assert w == ["kvarn eval: warning: --sink-tokens 4 does nothing for int8: only KVarN formats "
                 "(kvarn_*) keep a staged sink"], r.stderr
    assert w[0][len("kvarn eval: warning: "):] in json.loads(r.stdout)["warnings"]
    # --kvarn-staging too, in every command that takes it
    for cmd, extra in (("inspect", shape), ("passkey", ["-m", model_path, "--lengths", "64",
                                                        "--depths", "0"]),
                       ("eval", ["-m", model_path, "-f", str(text), "--ctx", "32", "--chunk", "8",
                                 "--decode-tokens", "4"]),
                       ("generate", ["-m", model_path, "-p", "Hi", "-n", "1"])):
        r = run([kvarn_bin, cmd, "--kv-cache-dtype", "int8", "--kvarn-staging", "int4"] + extra)
        assert r.returncode == 0, (cmd, r.stderr)
        assert sink_warnings(r.stderr, cmd) == [
            f"kvarn {cmd}: warning: --kvarn-staging int4 does nothing for int8: only KVarN "
            "formats (kvarn_*) stage tokens"], (cmd, r.stderr)
        r = run([kvarn_bin, cmd, "--kv-cache-dtype", "kvarn_k4v2_g128", "--kvarn-staging",
                 "int4"] + extra)
        assert r.returncode == 0 and sink_warnings(r.stderr, cmd) == [], (cmd, r.stderr)


def test_eval_passkey_needs_room_for_its_prompt(kvarn_bin, model_path, austen_path):
    """--passkey runs at length --ctx; a --ctx below the passkey prompt's
    fixed part (intro, key, question: 64 tokens with this tokenizer) is a
    usage error before the run, naming the smallest --ctx that works --
    not a "block pool exhausted" after the whole eval."""
    base = [kvarn_bin, "eval", "-m", model_path, "-f", austen_path, "--decode-tokens", "0",
            "--kv-cache-dtype", "int8", "--passkey", "1", "--json"]
    for ctx in ("8", "40", "63"):
        r = run(base + ["--ctx", ctx])
        assert r.returncode == 2, (ctx, r.stderr)
        lines = [l for l in r.stderr.splitlines() if l.startswith("kvarn ")]
        assert lines == ["kvarn eval: --passkey needs --ctx 64 or more (the passkey prompt is --ctx "
                         "tokens; its intro, key and question take 64)"], r.stderr
        assert r.stdout == "" and "kvarn eval: " not in r.stderr.replace(lines[0], "")
    r = run(base + ["--ctx", "64"])
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["reference"]["passkey_trials"] == 3
    # its progress is named as eval's passkey column, not as `kvarn passkey`
    assert "kvarn eval passkey: 6/6" in r.stderr and "kvarn passkey" not in r.stderr, r.stderr


@pytest.mark.parametrize("opt", ["--layers", "--kv-heads"])
def test_inspect_shape_beyond_the_cache_limits(kvarn_bin, opt):
    """--layers / --kv-heads take what a cache takes (KVARN_CACHE_MAX_LAYERS,
    _KV_HEADS: 4096): 4097 is a usage error naming the limit, not an
    "invalid argument" per format and an empty table."""
    shape = {"--layers": "1", "--kv-heads": "1"}
    shape[opt] = "4097"
    r = run([kvarn_bin, "inspect", "--layers", shape["--layers"], "--kv-heads", shape["--kv-heads"],
             "--head-dim", "64", "--kv-cache-dtype", "int8"])
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"kvarn inspect: bad value '4097' for {opt} "
                                "(expected an integer from 1 to 4096)")
    assert r.stdout == ""
    shape[opt] = "4096"
    r = run([kvarn_bin, "inspect", "--layers", shape["--layers"], "--kv-heads", shape["--kv-heads"],
             "--head-dim", "64", "--kv-cache-dtype", "int8"])
    assert r.returncode == 0 and "\nint8 " in r.stdout, r.stderr
