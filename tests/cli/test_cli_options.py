"""The options of `kvarn eval`, `passkey` and `inspect` (issue 9.5): each
command parses them from one table through getopt_long
(tools/cli_options.c, as `generate` does: test_cli_generate_options.py).
Usage errors exit 2 with one message naming the option and what it takes,
before any model or text is read; --help lists the table's options."""
import subprocess

import pytest


def kvarn(kvarn_bin, *args):
    return subprocess.run([kvarn_bin, *args], capture_output=True, text=True, timeout=600)


# Arguments that make each command's other requirements met (or not yet
# checked), so that only the option under test can fail.
BASE = {
    "eval": ["-m", "absent.gguf", "-f", "absent.txt"],
    "passkey": ["-m", "absent.gguf"],
    "inspect": ["--layers", "2", "--kv-heads", "2", "--head-dim", "64"],
}

# (command, the options --help lists in its first column, in table order)
HELP_COLUMNS = [
    ("eval", ["--kv-cache-dtype", "--ctx", "--chunk", "--windows", "--decode-tokens", "--threads",
              "--passkey", "--sink-tokens", "--tail-page-tokens", "--kvarn-staging", "--rtn-mse",
              "--rtn-mse-values", "--json", "--dump-kv",
              "--dump-layers"]),
    ("passkey", ["--kv-cache-dtype", "--lengths", "--depths", "--trials", "--chunk", "--seed",
                 "--threads", "--sink-tokens", "--kvarn-staging"]),
    ("inspect", ["--kv-cache-dtype", "-m", "--layers", "--kv-heads", "--head-dim", "--budget",
                 "--max-seqs", "--sink-tokens", "--tail-page-tokens", "--kvarn-staging"]),
]


@pytest.mark.parametrize("cmd,columns", HELP_COLUMNS)
def test_help_lists_the_table(kvarn_bin, cmd, columns):
    r = kvarn(kvarn_bin, cmd, "--help")
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout.startswith(f"usage: kvarn {cmd}")
    # the option lines: after the usage's blank line, until the notes (the
    # first line that is neither an option nor a continuation)
    lines = r.stdout.splitlines()
    block = []
    for line in lines[lines.index("") + 1:]:
        if not line.startswith(("-", " ")):
            break
        block.append(line)
    first = [line.split()[0] for line in block if line.startswith("-")]
    assert first == columns
    # -h is --help, and it wins over options after it
    assert kvarn(kvarn_bin, cmd, *BASE[cmd], "-h", "--ctx", "0").stdout == r.stdout


@pytest.mark.parametrize("cmd", ["eval", "passkey", "inspect"])
def test_kvarn_staging_names(kvarn_bin, cmd):
    """--kvarn-staging takes fp16, int8, fp8_e4m3 (alias fp8) or int4
    (cache.h staging); another name -- a per-token format that is no
    staging, fp16's alias auto, a KVarN format -- is a usage error naming
    them, before any model or text is read."""
    for bad in ("fp6", "INT8", "", "fp8_e5m2", "bf16", "auto", "kvarn_k4v2_g128"):
        r = kvarn(kvarn_bin, cmd, *BASE[cmd], "--kvarn-staging", bad)
        assert r.returncode == 2, (bad, r.stderr)
        assert r.stderr == (f"kvarn {cmd}: --kvarn-staging {bad}: unknown staging format; "
                            "expected fp16, int8, fp8_e4m3 (alias fp8) or int4\n")
    if cmd == "inspect":
        for good in ("fp16", "int8", "fp8_e4m3", "fp8", "int4"):
            r = kvarn(kvarn_bin, cmd, *BASE[cmd], "--kv-cache-dtype", "kvarn_k4v2_g128",
                      "--budget", "64MiB", "--kvarn-staging", good)
            assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("cmd", sorted(BASE))
def test_unknown_option(kvarn_bin, cmd):
    for args, name in ((["--bogus"], "--bogus"), (["--bogus", "1"], "--bogus"), (["-x"], "-x"),
                       (["--json=1"] if cmd == "eval" else ["--help=1"],
                        "--json=1" if cmd == "eval" else "--help=1"),
                       (["stray"], "stray")):
        r = kvarn(kvarn_bin, cmd, *BASE[cmd], *args)
        assert r.returncode == 2, (args, r.stderr)
        what = ("unexpected argument '{}' (not an option or an option's value)" if name == "stray"
                else "unknown option '{}'").format(name)
        assert r.stderr.startswith(f"kvarn {cmd}: {what}\nusage: kvarn {cmd}"), args


MISSING = [("eval", "--ctx"), ("eval", "-f"), ("eval", "--dump-kv"), ("passkey", "--lengths"),
           ("passkey", "--kv-cache-dtype"), ("eval", "--sink-tokens"), ("passkey", "--sink-tokens"), ("inspect", "--budget"), ("inspect", "-m")]


@pytest.mark.parametrize("cmd,opt", MISSING)
def test_missing_value(kvarn_bin, cmd, opt):
    r = kvarn(kvarn_bin, cmd, *BASE[cmd], opt)
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"kvarn {cmd}: option '{opt}' needs a value\n"


# (command, option, a value it refuses, what the message says it takes)
BAD_VALUES = [
    ("eval", "--ctx", "1", "an integer from 2 to 1048576"),
    ("eval", "--ctx", "2k", "an integer from 2 to 1048576"),
    ("eval", "--chunk", "4097", "an integer from 1 to 4096"),
    ("eval", "--windows", "0", "an integer from 1 to 1048576"),
    ("eval", "--decode-tokens", "-1", "an integer from 0 to 1048576"),
    ("eval", "--threads", "257", "an integer from 1 to 256"),
    ("eval", "--passkey", "1001", "an integer from 0 to 1000"),
    ("eval", "--dump-layers", "0", "an integer from 1 to 1048576"),
    ("eval", "--sink-tokens", "-1", "an integer from 0 to 65536"),
    ("passkey", "--sink-tokens", "65537", "an integer from 0 to 65536"),
    ("passkey", "--trials", "0", "an integer from 1 to 1000"),
    ("passkey", "--chunk", "x", "an integer from 1 to 4096"),
    ("passkey", "--seed", "-1", "an integer from 0 to 2147483647"),
    ("passkey", "--lengths", "63", "a comma-separated list of at most 16 integers from 64 to 1048576"),
    ("passkey", "--lengths", "1024,,2048", "a comma-separated list of at most 16 integers from 64 to 1048576"),
    ("passkey", "--lengths", "1024,", "a comma-separated list of at most 16 integers from 64 to 1048576"),
    ("passkey", "--lengths", ",".join(["64"] * 17),
     "a comma-separated list of at most 16 integers from 64 to 1048576"),
    ("passkey", "--depths", "0,101", "a comma-separated list of at most 16 integers from 0 to 100"),
    ("passkey", "--depths", "50%", "a comma-separated list of at most 16 integers from 0 to 100"),
    ("inspect", "--layers", "0", "an integer from 1 to 4096"),
    ("inspect", "--kv-heads", "two", "an integer from 1 to 4096"),
    ("inspect", "--head-dim", "1025", "an integer from 1 to 1024"),
    ("inspect", "--max-seqs", "0", "an integer from 1 to 1000000"),
    ("inspect", "--budget", "16 GiB", "a byte size such as 16GiB, 512MiB or 2GB"),
    ("inspect", "--budget", "-1GiB", "a byte size such as 16GiB, 512MiB or 2GB"),
]


@pytest.mark.parametrize("cmd,opt,value,expected", BAD_VALUES)
def test_bad_value(kvarn_bin, cmd, opt, value, expected):
    r = kvarn(kvarn_bin, cmd, *BASE[cmd], opt, value)
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"kvarn {cmd}: bad value '{value}' for {opt} (expected {expected})\n"


def test_spellings_agree(kvarn_bin):
    """--opt=value, --opt value and the long names give the same run."""
    base = ["--kv-cache-dtype", "int8,kvarn_k4v2_g128", "--budget"]
    a = kvarn(kvarn_bin, "inspect", "--layers", "30", "--kv-heads", "3", "--head-dim", "64",
              *base, "1GiB")
    b = kvarn(kvarn_bin, "inspect", "--layers=30", "--kv-heads=3", "--head-dim=64",
              "--kv-cache-dtype=int8,kvarn_k4v2_g128", "--budget=1GiB")
    assert a.returncode == 0 and a.stdout and a.stdout == b.stdout
