"""The C tokenizer against an independent one: HF `tokenizers` built from the
same GGUF vocabulary and merges (read with the `gguf` package) with the
SmolLM2 pre-tokenizer (digits split one by one, then ByteLevel with the
GPT-2 pattern) and the control tokens as special added tokens.

The C side is tests/cli/tokenize_cli.c, compiled here against
$KVARN_BUILD_DIR/libkvarn.a (default <repo>/build, which scripts/test.sh
builds before running the Python tests).
"""
import os
import random
import subprocess

import pytest
from conftest import CONTROL, require_model

# scripts/setup.sh installs both: a missing one is a broken set-up (fail),
# not a reason to skip.
import gguf  # noqa: F401
import tokenizers  # noqa: F401

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
AUSTEN = os.path.join(REPO, "data", "austen", "all.txt")
BUILD = os.environ.get("KVARN_BUILD_DIR", os.path.join(REPO, "build"))

@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    require_model()
    lib = os.path.join(BUILD, "libkvarn.a")
    if not os.path.exists(lib):
        pytest.fail(f"{lib} absent: build first (scripts/test.sh, or set KVARN_BUILD_DIR)")
    exe = str(tmp_path_factory.mktemp("tok") / "tokenize_cli")
    subprocess.run(
        ["cc", "-std=c11", "-O2", "-D_POSIX_C_SOURCE=200809L",
         "-I", os.path.join(REPO, "include"),
         os.path.join(REPO, "tests", "cli", "tokenize_cli.c"), lib,
         "-lpcre2-8", "-lopenblas", "-lz", "-lm", "-lpthread", "-o", exe],
        check=True)
    # The model is present: it must load (an empty batch of lines).
    r = subprocess.run([exe, MODEL, "lines"], input=b"", capture_output=True)
    if r.returncode != 0:
        pytest.fail(f"{MODEL} is present but does not load: {r.stderr.decode(errors='replace')}")
    return exe


def c_encode(cli, texts, special=False):
    """[(ids, decoded bytes)] of the C tokenizer for each text (str or bytes)."""
    lines = []
    for t in texts:
        b = t.encode("utf-8") if isinstance(t, str) else t
        lines.append(("S " if special else "P ") + b.hex() + "\n")
    out = subprocess.run([cli, MODEL, "lines"], input="".join(lines).encode(),
                         capture_output=True, check=True).stdout.decode()
    res = []
    for line in out.splitlines():
        ids, dec = line.split("\t")
        res.append(([int(x) for x in ids.split()], bytes.fromhex(dec)))
    assert len(res) == len(texts)
    return res


def check_against_hf(cli, hf, texts, special=False):
    for t, (ids, dec) in zip(texts, c_encode(cli, texts, special)):
        want = hf.encode(t, add_special_tokens=False).ids
        assert ids == want, f"{t!r}: C {ids} HF {want}"
        assert dec == t.encode("utf-8"), f"{t!r}: decode gave {dec!r}"
        assert hf.decode(ids, skip_special_tokens=False) == t


def test_austen_lines(cli, hf):
    with open(AUSTEN, encoding="utf-8") as f:
        lines = [l for l in f.read().split("\n") if l.strip()]
    picked = random.Random(1811).sample(lines, 400)
    check_against_hf(cli, hf, picked)
    # Lines joined with their newlines: whitespace runs across line ends.
    check_against_hf(cli, hf, ["\n".join(picked[i:i + 8]) + "\n" for i in range(0, 400, 8)])


def test_austen_whole_text(cli, hf):
    with open(AUSTEN, encoding="utf-8") as f:
        text = f.read()
    (ids, dec), = c_encode(cli, [text])
    want = hf.encode(text, add_special_tokens=False).ids
    assert len(ids) == len(want)
    first = next((i for i, (a, b) in enumerate(zip(ids, want)) if a != b), None)
    assert first is None, f"first difference at token {first}: C {ids[first:first + 8]} HF {want[first:first + 8]}"
    assert dec == text.encode("utf-8")


def test_non_ascii(cli, hf):
    check_against_hf(cli, hf, [
        "Café, naïve façade, Æsop, Ångström, Øresund, Straße",
        "“Curly quotes” — em dash – en dash … ellipsis ‘single’",
        "日本語のテキストと中文文本，还有한국어 텍스트",
        "Emoji: 🎉👍🏽 👨‍👩‍👧 🇫🇷 and ❤️",
        "Ελληνικά, Русский текст, עברית, العربية",
        "Ω≈ç√∫˜µ≤≥÷ ¡™£¢∞§¶•ªº–≠",
        "\u00a0no-break\u202fnarrow\u2009thin\u3000ideographic",
        "zero\u200bwidth\u200dthings\ufeff",
    ])


def test_digits(cli, hf):
    check_against_hf(cli, hf, [
        "In 1811, 2,500 pounds",
        "£10,000 a year; 3.14159; 1e-9; 0x1F; v2.0.1",
        "a1b22c333 4444",
        "x²½٣ ١٢٣ ⅓ Ⅻ 12345",
        " 7", "7 ", "  42  ",
    ])


def test_whitespace_and_newlines(cli, hf):
    check_against_hf(cli, hf, [
        "  multiple   spaces   between",
        "trailing spaces   ", "   leading", " ", "  ", "\n", "\n\n\n",
        "line one\nline two\n\nline four\r\nwindows\r\n",
        "\ttab\t\ttabs \t mixed \t\n\t",
        "word  1", "a\u180eb c\u0085d \u2028e",
        "it's they'll I'M we've she'd you're 'tis",
        "??!!...,,, ;; --- ((brackets)) [x] {y}",
    ])


def test_special_tokens(cli, hf, vocab):
    tokens, _, types = vocab
    texts = [
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
        "text<|endoftext|>more text<|endoftext|>",
        "<|im_start|><|im_end|><|im_start|>",
        "broken <|im_start| and <|im_end|>|> and <|im_start|>",
        "<repo_name>kvarn<file_sep>x = 1<|endoftext|>",
    ]
    check_against_hf(cli, hf, texts, special=True)
    # Without SPECIAL the control texts are plain text: no control id appears.
    control = {i for i, ty in enumerate(types) if ty == CONTROL}
    for t, (ids, dec) in zip(texts, c_encode(cli, texts, special=False)):
        assert not control & set(ids), t
        assert dec == t.encode("utf-8")


def test_chat_template(cli, hf):
    out = subprocess.run([cli, MODEL, "chat"], capture_output=True, check=True).stdout.decode()
    by_text, by_msgs = ([int(x) for x in l.split()] for l in out.splitlines())
    # The messages tokenize_cli.c formats, rendered here as SmolLM2's
    # tokenizer.chat_template renders them.
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    msgs = [("system", system), ("user", "What is the capital of France?"),
            ("assistant", "Paris, since 987."), ("user", "And of Spain?\n")]
    prompt = "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in msgs)
    prompt += "<|im_start|>assistant\n"
    want = hf.encode(prompt, add_special_tokens=False).ids
    assert by_text == want
    assert by_msgs == want


def gpt2_byte_chars():
    """GPT-2's byte -> character table, written from its definition."""
    keep = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def test_bytes_without_token(cli, hf, vocab):
    # Valid UTF-8 holding bytes the vocabulary lacks: both sides drop them.
    tokens = set(vocab[0])
    missing = [b for b, ch in gpt2_byte_chars().items() if ch not in tokens]
    assert 0x04 in missing and 0x41 not in missing
    check = ["a\x04b", "!!\x04!!", "\x04\x06\x13", "x \x1d y"]
    for t, (ids, dec) in zip(check, c_encode(cli, check)):
        assert ids == hf.encode(t, add_special_tokens=False).ids, repr(t)
        assert dec == bytes(b for b in t.encode() if b not in missing)


def test_invalid_utf8_round_trip(cli, vocab):
    tokens = set(vocab[0])
    missing = {b for b, ch in gpt2_byte_chars().items() if ch not in tokens}
    rng = random.Random(7)
    texts = [b"\xff\xfe abc \xc3", b"\xed\xa0\x80 surrogate", b"\xc0\xaf overlong",
             b"\xf4\x90\x80\x80 too big", b"ok \xe2\x82 cut", b"\x00nul\x00"]
    texts += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))) for _ in range(50)]
    for t, (ids, dec) in zip(texts, c_encode(cli, texts)):
        assert dec == bytes(b for b in t if b not in missing), t
        assert all(0 <= i < len(vocab[0]) for i in ids)


def test_whole_austen(cli):
    """All of Austen in one call (no time limit: speed is a benchmark's job;
    the time is printed)."""
    out = subprocess.run([cli, MODEL, "file", AUSTEN], capture_output=True, check=True)
    nbytes, ntok, secs = out.stdout.decode().split()
    print(f"encoded {nbytes} bytes into {ntok} tokens in {secs} s")
    assert int(nbytes) > 3_000_000 and int(ntok) > 500_000
