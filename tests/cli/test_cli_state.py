"""`kvarn generate --save-state F / --load-state F` (tools/gen_state.c,
docs/state.md): a run stopped and continued from its saved state gives the
tokens of one run that never stopped, bit for bit: the two saved files
(token ids, last logits, sampler, the cache's sequence stream) are
byte-identical; and a state file of another format or staging, a truncated
one and a corrupted one are refused with one line and exit status 2."""
import struct
import subprocess

import pytest

# A prompt of about 260 tokens: with 2 x 40 generated tokens the sequence
# crosses the sink tile and commits a quantized tile (G = 128).
PROMPT = " ".join(["The history of the river town begins with a mill, a bridge and a "
                   "market square where farmers sold grain."] * 12)


def generate(kvarn_bin, *args):
    return subprocess.run([kvarn_bin, "generate", *args], capture_output=True, text=True,
                          timeout=600)


def header(path):
    """magic, n_tokens, library stream bytes of a state file (docs/state.md)."""
    b = open(path, "rb").read()
    return b[:8], struct.unpack_from("<I", b, 68)[0], struct.unpack_from("<Q", b, 80)[0], b


@pytest.mark.parametrize("dtype", ["kvarn_k4v2_g128", "int8"])
def test_stop_and_continue_equals_one_run(kvarn_bin, model_path, tmp_path, dtype):
    m = model_path
    one, a, b = tmp_path / "one.st", tmp_path / "a.st", tmp_path / "b.st"
    common = ["-m", m, "--temp", "0", "--kv-cache-dtype", dtype]
    r = generate(kvarn_bin, *common, "-p", PROMPT, "-n", "80", "--save-state", str(one))
    assert r.returncode == 0, r.stderr
    r1 = generate(kvarn_bin, *common, "-p", PROMPT, "-n", "40", "--save-state", str(a))
    assert r1.returncode == 0, r1.stderr
    r2 = generate(kvarn_bin, *common, "--load-state", str(a), "-n", "40", "--save-state", str(b))
    assert r2.returncode == 0, r2.stderr
    magic, n_one, _, bytes_one = header(one)
    assert magic == b"KVARNGEN"
    _, n_a, _, _ = header(a)
    _, n_b, _, bytes_b = header(b)
    assert n_a == n_one - 40 and n_b == n_one > 256  # no end-of-text cut the runs short
    # the same token ids, logits and cache bytes: decode was bit-identical
    assert bytes_b == bytes_one
    assert r1.stdout.rstrip("\n") + r2.stdout.rstrip("\n") == r.stdout.rstrip("\n")


def test_prompt_after_load_is_appended(kvarn_bin, model_path, tmp_path):
    m = model_path
    a, b = tmp_path / "a.st", tmp_path / "b.st"
    assert generate(kvarn_bin, "-m", m, "-p", "Once upon a time", "-n", "8", "--temp", "0",
                    "--save-state", str(a)).returncode == 0
    r = generate(kvarn_bin, "-m", m, "--load-state", str(a), "-p", " and then", "-n", "4",
                 "--temp", "0", "--save-state", str(b))
    assert r.returncode == 0, r.stderr
    _, n_a, _, _ = header(a)
    _, n_b, _, _ = header(b)
    assert n_b > n_a + 4  # the prompt's tokens, then the reply's


def test_refused_state_files(kvarn_bin, model_path, tmp_path):
    m = model_path
    a = tmp_path / "a.st"
    assert generate(kvarn_bin, "-m", m, "-p", "Once upon a time", "-n", "4", "--temp", "0",
                    "--save-state", str(a)).returncode == 0
    data = a.read_bytes()
    cases = []
    cases.append((["--kv-cache-dtype", "int8"], data,
                  "saved with --kv-cache-dtype kvarn_k4v2_g128; this run uses int8"))
    cases.append((["--kvarn-staging", "fp16"], data,
                  "saved with --kvarn-staging int8; this run uses fp16"))
    cases.append(([], data[:1000], f"truncated (1000 of {len(data)} bytes)"))
    cases.append(([], data[:50], "truncated (50 bytes)"))
    flipped = bytearray(data)
    flipped[200] ^= 1  # in the token ids or logits
    cases.append(([], bytes(flipped), "corrupted (checksum mismatch)"))
    flipped = bytearray(data)
    flipped[-10] ^= 1  # in the library's stream
    cases.append(([], bytes(flipped), "checksum mismatch"))
    cases.append(([], b"GGUF" + data[4:], "not a kvarn generate state file"))
    for i, (opts, content, msg) in enumerate(cases):
        f = tmp_path / f"bad{i}.st"
        f.write_bytes(content)
        r = generate(kvarn_bin, "-m", m, "--load-state", str(f), "-n", "2", *opts)
        assert r.returncode == 2, (i, r.stderr)
        assert r.stderr == f"kvarn generate: --load-state {f}: {msg}\n", i
        assert r.stdout == ""
    r = generate(kvarn_bin, "-m", m, "--load-state", str(tmp_path / "none.st"), "-n", "2")
    assert r.returncode == 2 and "cannot open" in r.stderr
    r = generate(kvarn_bin, "-m", m, "--load-state", str(a), "--chat")
    assert r.returncode == 2 and "not --chat" in r.stderr
