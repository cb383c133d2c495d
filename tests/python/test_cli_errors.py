"""Bad inputs to the kvarn command: each a clear message on stderr and a
non-zero exit, nothing else broken (issue: the kvarn command, tests)."""
import subprocess


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=600, **kw)


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
