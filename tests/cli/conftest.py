"""Shared fixtures of the Python tests: where the repository, the build and
the evaluation model are. The tests run after scripts/test.sh has built
build/ and scripts/get_model.sh has fetched the model and text. A test that
needs the model skips when the file is absent and fails when it is present
but does not load; a missing build or text fails."""
import os
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("KVARN_BUILD_DIR", REPO / "build"))
MODEL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
AUSTEN = REPO / "data" / "austen" / "all.txt"

# The bounds of these tests are derived for fp32 weights: every run of the
# library (the kvarn command, the helpers) loads them in fp32 unless a test
# asks for bf16 itself (KVARN_WEIGHTS in its subprocess environment).
os.environ["KVARN_WEIGHTS"] = "fp32"


def pytest_configure(config):
    """Under pytest-xdist (scripts/test.sh: `-n N`, one worker per core),
    each worker keeps to CPUs of its own, its OpenBLAS and OpenMP threads
    with it (tests/common/xdist_pin.py)."""
    sys.path.insert(0, str(REPO / "tests" / "common"))
    from xdist_pin import pin_worker
    pin_worker()


def ext_libs():
    """What a program linking build/libkvarn.a needs besides it: OpenBLAS,
    PCRE2, zlib (the state stream's CRC-32), and oneDNN when the build found it (CMakeCache's DNNL_LIB)."""
    libs = ["-lopenblas", "-lpcre2-8", "-lz", "-lm", "-lpthread"]
    cache = BUILD / "CMakeCache.txt"
    if cache.exists():
        for line in cache.read_text().splitlines():
            if line.startswith("DNNL_LIB:") and not line.endswith("NOTFOUND"):
                libs.insert(0, line.split("=", 1)[1])
    return libs


@pytest.fixture(scope="session")
def kvarn_bin():
    exe = BUILD / "kvarn"
    if not exe.exists():
        pytest.fail(f"{exe} is missing: build first (bash scripts/test.sh builds it)")
    return str(exe)


def require_model():
    """The model's path. Absent: the test skips (visibly, with how to fetch
    it); present but unreadable: the test fails (where it reads it)."""
    if not MODEL.exists():
        pytest.skip(f"{MODEL} is absent: run bash scripts/setup.sh --model")
    return str(MODEL)


@pytest.fixture(scope="session")
def model_path():
    return require_model()


@pytest.fixture(scope="session")
def austen_path():
    if not AUSTEN.exists():
        pytest.fail(f"{AUSTEN} is missing: run bash scripts/setup.sh --model")
    return str(AUSTEN)


CONTROL = 3  # tokenizer.ggml.token_type of "<|im_start|>" etc.


@pytest.fixture(scope="session")
def vocab():
    import gguf
    r = gguf.GGUFReader(require_model())

    def strings(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    f = r.fields["tokenizer.ggml.token_type"]
    types = [int(f.parts[i][0]) for i in f.data]
    return strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges"), types


@pytest.fixture(scope="session")
def hf(vocab):
    """An independent tokenizer: HF tokenizers' BPE on the GGUF's vocabulary
    and merges with SmolLM2's pre-tokenizer (digits one by one, ByteLevel)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, merges, types = vocab
    ids = {t: i for i, t in enumerate(tokens)}
    assert len(ids) == len(tokens)  # no repeated token texts
    tk = Tokenizer(models.BPE(vocab=ids, merges=[tuple(m.split(" ", 1)) for m in merges]))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if ty == CONTROL])
    return tk
