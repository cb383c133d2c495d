"""test_gguf_dequant.py -- the C GGUF reader's dequantization against PyPI's
`gguf` package on the real evaluation model (../shared/EVAL.md).

For every tensor type present in the model (Q4_1, Q8_0, F32 in SmolLM2),
the first, a middle and the last tensor of that type are dequantized by the
C reader (through the helper tests/cli/dump_tensor.c, compiled here
against libkvarn.a) and by gguf.quants.dequantize; shapes, types and every
value must agree. Run after scripts/test.sh (or any cmake build) has built
the library: the build directory is $KVARN_BUILD_DIR, default <repo>/build.
"""
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize

from conftest import require_model

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILD = Path(os.environ.get("KVARN_BUILD_DIR", REPO / "build"))


@pytest.fixture(scope="module")
def dump_tensor(tmp_path_factory):
    lib = BUILD / "libkvarn.a"
    if not lib.exists():
        pytest.fail(f"{lib} not found: build the library first (scripts/test.sh, "
                    "or cmake -S . -B build && cmake --build build), or set KVARN_BUILD_DIR")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler (cc) found"
    exe = tmp_path_factory.mktemp("dump") / "dump_tensor"
    base = [cc, "-std=c11", "-O2", "-D_POSIX_C_SOURCE=200809L", "-Wall", "-Werror",
            "-I", str(REPO / "include"), str(REPO / "tests" / "cli" / "dump_tensor.c"),
            str(lib), "-o", str(exe)]
    # The archive members the reader needs use libm only; the extra libraries
    # are what the whole libkvarn links with, for archives that pull more.
    for extra in (["-lm"], ["-lopenblas", "-lpcre2-8", "-lz", "-lpthread", "-lm"]):
        r = subprocess.run(base + extra, capture_output=True, text=True)
        if r.returncode == 0:
            return exe
    pytest.fail(f"cannot build dump_tensor.c against {lib}:\n{r.stderr}")


@pytest.fixture(scope="module")
def reader():
    return GGUFReader(require_model())


def pick_tensors(reader):
    """First, middle and last tensor of each type in the file."""
    by_type = {}
    for t in reader.tensors:
        by_type.setdefault(t.tensor_type.name, []).append(t)
    picked = []
    for ts in by_type.values():
        idx = sorted({0, len(ts) // 2, len(ts) - 1})
        picked += [ts[i] for i in idx]
    return by_type.keys(), picked


def test_types_present(reader):
    types, _ = pick_tensors(reader)
    # EVAL.md: Q4_1 matrices, a Q8_0 (or F16) embedding, F32 norms.
    assert "Q4_1" in types and "F32" in types
    assert "Q8_0" in types or "F16" in types


def test_dequant_matches_gguf_package(reader, dump_tensor, tmp_path):
    _, picked = pick_tensors(reader)
    names = [t.name for t in picked]
    r = subprocess.run([str(dump_tensor), str(MODEL), str(tmp_path)] + names,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().split("\n")
    assert len(lines) == len(picked)
    for i, (t, line) in enumerate(zip(picked, lines)):
        name, tname, n_dims, *ne = line.split()
        assert name == t.name
        assert tname == t.tensor_type.name
        assert int(n_dims) == len(t.shape)
        # gguf's shape lists ne[0] (innermost) first, like ours.
        assert [int(x) for x in ne[:len(t.shape)]] == [int(x) for x in t.shape]
        ours = np.fromfile(tmp_path / f"{i}.f32", dtype="<f4")
        ref = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        assert ours.size == ref.size == int(t.n_elements), name
        assert np.all(np.isfinite(ours)), name
        diff = np.abs(ours.astype(np.float64) - ref.astype(np.float64))
        scale = max(float(np.abs(ref).max()), 1e-30)
        # Same block formula in fp32 on both sides: agreement to the last
        # bit or within one fp32 rounding of the largest value.
        assert diff.max() <= scale * 2.0 ** -22, (
            f"{name} ({tname}): max |diff| {diff.max():g} at {int(diff.argmax())}, "
            f"largest |x| {scale:g}")
        # And the values carry information (not all zero, not constant).
        assert np.std(ref) > 0 and np.count_nonzero(ours) > ours.size // 2, name


def test_dump_tensor_reports_errors(dump_tensor, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 16)
    r = subprocess.run([str(dump_tensor), str(bad), str(tmp_path), "x"],
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert "more than the file can hold" in r.stderr or "truncated" in r.stderr, r.stderr
