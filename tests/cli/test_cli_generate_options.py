"""`kvarn generate`'s options (tools/cmd_generate.c: one table drives
getopt_long, the value checks and --help): each option's spelling and
range, the usage errors (exit 2) and what --help lists. The error texts
that every command shares are in test_cli_errors.py."""
import re
import subprocess

import pytest


def generate(kvarn_bin, *args, stdin=None):
    return subprocess.run([kvarn_bin, "generate", *args], capture_output=True, text=True,
                          timeout=600, input=stdin)


def test_help_lists_every_documented_option(kvarn_bin):
    r = generate(kvarn_bin, "--help")
    assert r.returncode == 0 and r.stderr == ""
    first_column = [line.split()[0] for line in r.stdout.splitlines()[4:]
                    if line.startswith("-")]
    assert first_column == ["-p", "--chat", "-n", "--temp", "--top-p", "--seed",
                            "--kv-cache-dtype", "--threads", "--ctx", "--kvarn-staging",
                            "--save-state", "--load-state"]
    assert "(alias --max-tokens;" in r.stdout
    # -h is --help, wherever it stands (even after a value error would come)
    assert generate(kvarn_bin, "-m", "x", "-h", "-n", "0").stdout == r.stdout


def test_missing_value_and_unknown_option_are_told_apart(kvarn_bin):
    for opt in ("-n", "--ctx", "-p", "--max-tokens", "-m"):
        r = generate(kvarn_bin, "-m", "x", opt)
        assert r.returncode == 2, (opt, r.stderr)
        assert r.stderr == f"kvarn generate: option '{opt}' needs a value\n", opt
    for args, name in ((["--bogus"], "--bogus"), (["--bogus", "1"], "--bogus"), (["-x"], "-x"),
                       (["--chat=1"], "--chat=1"), (["-p", "hi", "stray"], "stray")):
        r = generate(kvarn_bin, "-m", "x", *args)
        assert r.returncode == 2, (args, r.stderr)
        what = ("unexpected argument '{}' (not an option or an option's value)" if name == "stray"
                else "unknown option '{}'").format(name)
        assert r.stderr.startswith(f"kvarn generate: {what}\nusage: kvarn generate"), args


# (option, a value outside its range, the range as the message states it)
OUT_OF_RANGE = [
    ("-n", "0", "an integer from 1 to 1048576"),
    ("--threads", "257", "an integer from 1 to 256"),
    ("--seed", "-1", "an integer from 0 to 2147483647"),
    ("--ctx", "0", "an integer from 1 to 2147483647"),
    ("--max-tokens", "2147483648", "an integer from 1 to 2147483647"),
    ("--temp", "-0.5", "a finite number from 0 up"),
    ("--temp", "inf", "a finite number from 0 up"),
    ("--top-p", "0", "a number above 0 and at most 1"),
    ("--top-p", "1.01", "a number above 0 and at most 1"),
]


@pytest.mark.parametrize("opt,value,expected", OUT_OF_RANGE)
def test_value_out_of_range(kvarn_bin, opt, value, expected):
    r = generate(kvarn_bin, "-m", "x", "-p", "hi", opt, value)
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"kvarn generate: bad value '{value}' for {opt} (expected {expected})\n"


def test_spellings_of_one_run_agree(kvarn_bin, model_path):
    # Greedy, so every spelling of the same options must print the same text
    # and the same cache size line.
    base = ["-m", model_path, "-p", "The capital of France is", "--temp", "0",
            "--kv-cache-dtype", "int8"]
    runs = [
        base + ["-n", "3", "--ctx", "64"],
        base + ["-n3", "--max-tokens", "64"],
        base + ["-n", "3", "--ctx=64"],
        ["--model", model_path, "--prompt", "The capital of France is", "--temp=0",
         "--kv-cache-dtype=int8", "-n", "3", "--ctx", "64"],
    ]
    outs = []
    for args in runs:
        r = generate(kvarn_bin, *args)
        assert r.returncode == 0, (args, r.stderr)
        kv_line = [line for line in r.stderr.splitlines() if "KV cache for" in line]
        outs.append((r.stdout, kv_line))
    assert outs[0][0].strip(), outs[0]
    assert all(o == outs[0] for o in outs), outs


UNITS = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}


def test_memory_line_states_which_way_the_ratio_goes(kvarn_bin, model_path):
    # It read "KV cache for 11 tokens: 2.8 MiB; an fp16 cache: 360.0 KiB
    # (800% of it)": 800% of which? Now the ratio is this cache's bytes over
    # an fp16 cache's for the same tokens, said so. int8 takes 12240 of
    # fp16's 23040 bytes a token (both in 16-token blocks): below 1; a short
    # KVarN text holds whole staged sink and tail tiles: above 1.
    for fmt, above_one in (("int8", False), ("kvarn_k4v2_g128", True)):
        r = generate(kvarn_bin, "-m", model_path, "-p", "The capital of France is", "-n", "4",
                     "--temp", "0", "--kv-cache-dtype", fmt)
        assert r.returncode == 0, r.stderr
        m = re.search(rf"^\[{fmt}\] KV cache for (\d+) tokens: ([\d.]+) (B|KiB|MiB|GiB), "
                      r"([\d.]+)x the size of an fp16 cache \(([\d.]+) (B|KiB|MiB|GiB)\)",
                      r.stderr, re.M)
        assert m, r.stderr
        used, base = float(m[2]) * UNITS[m[3]], float(m[5]) * UNITS[m[6]]
        ratio = float(m[4])
        # each size is printed rounded to 0.1 of its unit (whole bytes for
        # B): the exact sizes lie within half of that, so their ratio within
        # [lo, hi]; the ratio itself is printed to 0.005
        half_u = 0.05 * UNITS[m[3]] if m[3] != "B" else 0.5
        half_b = 0.05 * UNITS[m[6]] if m[6] != "B" else 0.5
        lo, hi = (used - half_u) / (base + half_b), (used + half_u) / (base - half_b)
        assert lo - 0.005 <= ratio <= hi + 0.005, (ratio, lo, hi, m[0])
        assert (ratio > 1) == above_one, m[0]
        assert "%" not in m[0]


KV_LINE = (r"^\[{fmt}\] KV cache for (\d+) tokens?: ([\d.]+) (B|KiB|MiB|GiB), "
           r"([\d.]+)x the size of an fp16 cache \(([\d.]+) (B|KiB|MiB|GiB)\)(.*)$")


def test_memory_line_says_when_the_cache_is_larger_than_fp16(kvarn_bin, model_path, austen_path):
    # A 6-token prompt in kvarn_k4v2_g128 holds a whole 128-token sink page:
    # 8.00x an fp16 cache of those tokens when staged in fp16, which the line
    # called "short texts gain little". It now says the cache is larger, in
    # which staging, and below how many tokens that holds.
    fmt = "kvarn_k4v2_g128"

    def short(*staging):
        r = generate(kvarn_bin, "-m", model_path, "-p", "The capital of France is", "-n", "4",
                     "--temp", "0", "--kv-cache-dtype", fmt, *staging)
        assert r.returncode == 0, r.stderr
        m = re.search(KV_LINE.format(fmt=fmt), r.stderr, re.M)
        assert m and float(m[4]) > 1, r.stderr
        tail = re.fullmatch(r": larger than an fp16 cache for so few tokens: the sink \(128 "
                            r"tokens\) and staging tail \(up to a 128-token tile\), staged (\w+), "
                            r"dominate; from (\d+) tokens on it is never larger; on long contexts "
                            r"kvarn_k4v2_g128 holds 4\.49x as many tokens as fp16 in the same memory",
                            m[7])
        assert tail, m[0]
        assert "gain little" not in m[0]
        return tail[1], int(tail[2])

    # fp16 staging: the sink and one tail tile, 256 fp16 tokens, cost what
    # an fp16 cache of 256 tokens does: the break-even lies beyond
    name, below16 = short("--kvarn-staging", "fp16")
    assert name == "fp16" and 256 < below16 <= 1024, (name, below16)
    # the default stages int8 records (136 of fp16's 256 bytes per
    # token-head at head_dim 64): 256 staged tokens cost 136 fp16 tokens'
    # bytes, so it breaks even beyond 136 and sooner than fp16 staging
    name, below8 = short()
    assert name == "int8" and 136 < below8 < below16, (name, below8, below16)
    # int4 records (72 bytes), sooner still; the line names the staging
    name, below4 = short("--kvarn-staging", "int4")
    assert name == "int4" and below4 < below8, (name, below4, below8)
    # a prompt of more than that many tokens: smaller than fp16, said so
    text = open(austen_path, encoding="utf-8").read()[:8 * below16]
    r = generate(kvarn_bin, "-m", model_path, "-p", text, "-n", "1", "--temp", "0",
                 "--kv-cache-dtype", fmt)
    assert r.returncode == 0, r.stderr
    m = re.search(KV_LINE.format(fmt=fmt), r.stderr, re.M)
    assert m and int(m[1]) >= below16 and float(m[4]) < 1, r.stderr
    assert "larger" not in m[0] and m[7].startswith(
        "; the sink (128 tokens) and the last partial tile stay staged int8"), m[0]
    # a per-token format is never larger: no such clause
    r = generate(kvarn_bin, "-m", model_path, "-p", "The capital of France is", "-n", "4",
                 "--temp", "0", "--kv-cache-dtype", "int8")
    assert r.returncode == 0, r.stderr
    m = re.search(KV_LINE.format(fmt="int8"), r.stderr, re.M)
    assert m and float(m[4]) < 1 and m[7] == "", r.stderr


def test_memory_line_words_and_numbers_agree(kvarn_bin, model_path):
    """The ratio has the digits to be on the side of 1 the words say
    (kvarn_k8v8_g128 at 528 tokens read "1.00x ... larger than an fp16
    cache", staged in fp16); one token is "1 token"; nothing generated says so
    instead of "generation 0.0 tok/s"."""
    fmt = "kvarn_k8v8_g128"
    prompt = "the" + " the" * 526  # 527 tokens, one generated: 528
    r = generate(kvarn_bin, "-m", model_path, "-p", prompt, "-n", "1", "--temp", "0",
                 "--kv-cache-dtype", fmt, "--kvarn-staging", "fp16")
    assert r.returncode == 0, r.stderr
    m = re.search(KV_LINE.format(fmt=fmt), r.stderr, re.M)
    assert m and m[1] == "528", r.stderr
    assert m[7].startswith(": larger than an fp16 cache"), m[0]
    assert float(m[4]) > 1, m[0]
    below = int(re.search(r"from (\d+) tokens on it is never larger", m[7])[1])
    assert below > 528, m[0]
    r = generate(kvarn_bin, "-m", model_path, "-p", "hi", "--ctx", "1", "-n", "3", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert "] KV cache for 1 token: " in r.stderr, r.stderr
    assert re.search(r"^\[kvarn_k4v2_g128\] prompt [\d.]+ tok/s, no tokens generated$", r.stderr, re.M), r.stderr
    assert "generation 0.0" not in r.stderr
