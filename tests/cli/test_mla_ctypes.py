"""The mla_* ctypes section of python/kvarn_vllm/_lib.py against the C
library (include/kvarn/mla.h) and a NumPy reference: names, record sizes,
encode -> decode within each channel's RTN bound, absorbed attention
against a float64 softmax over the decoded records and the tail, errors as
exceptions. No vLLM or torch needed."""
import ctypes
import math
import os
import sys

import numpy as np
import pytest

from conftest import BUILD, REPO

os.environ.setdefault("KVARN_LIBRARY", str(BUILD / "libkvarn.so"))
sys.path.insert(0, str(REPO / "python"))
from kvarn_vllm import _lib  # noqa: E402

U = 2.0 ** -24  # fp32 unit roundoff


def ptr(a):
    return a.ctypes.data if a is not None else 0


def latent_like(rng, n, t0, D, R):
    """Unit-RMS latent rows with 8 outlier channels, RoPE'd rope rows."""
    lat = rng.standard_normal((n, D)).astype(np.float32)
    lat[:, 3::D // 8] *= 8.0
    i = np.arange(R // 2)
    th = (t0 + np.arange(n))[:, None] * 10000.0 ** (-2.0 * i / R)[None, :]
    x, y = 2.0 * rng.standard_normal((n, R // 2)) + 1.0, 2.0 * rng.standard_normal((n, R // 2))
    rope = np.empty((n, R), np.float32)
    rope[:, 0::2] = x * np.cos(th) - y * np.sin(th)
    rope[:, 1::2] = x * np.sin(th) + y * np.cos(th)
    return lat, rope


def fields(rec, fmt, D):
    """a_d, b_d (fp16 [D]) and s_tok (fp16 [G]) of a record, by mla.h's table."""
    G, kb = fmt.tile_tokens, fmt.latent_bits
    a_off = D * G * kb // 8
    a = rec[a_off:a_off + 2 * D].view(np.float16).astype(np.float64)
    b = rec[a_off + 2 * D:a_off + 4 * D].view(np.float16).astype(np.float64)
    s = rec[a_off + 4 * D:a_off + 4 * D + 2 * G].view(np.float16).astype(np.float64)
    return a, b, s


def test_names_and_sizes():
    f = _lib.mla_parse("kvarn_mla_k4_g128", 512, 64)
    assert (f.latent_bits, f.tile_tokens, f.rope_bits) == (4, 128, 8)
    # mla.h's table by hand: codes 512*128/2, a_d b_d 4*512, s_tok 2*128,
    # rope int8 128*64 + scale/zero 4*128; padded to 8
    assert _lib.mla_record_bytes(f, 512, 64) == 32768 + 2048 + 256 + 8192 + 512
    f16 = _lib.mla_parse("kvarn_mla_k2r16_g64")
    assert _lib.mla_record_bytes(f16, 256, 32) == 256 * 64 * 2 // 8 + 4 * 256 + 2 * 64 + 2 * 64 * 32
    with pytest.raises(ValueError, match="accepted"):
        _lib.mla_parse("kvarn_mla_k3_g128")
    with pytest.raises(ValueError, match="latent_dim"):
        _lib.mla_parse("kvarn_mla_k4_g128", 1024, 64)


@pytest.mark.parametrize("name,D,R", [("kvarn_mla_k4_g128", 512, 64),
                                      ("kvarn_mla_k2r16_g64", 128, 32),
                                      ("kvarn_mla_k8r8_g64", 64, 0)])
def test_encode_decode_attn(name, D, R):
    rng = np.random.default_rng(1)
    f = _lib.mla_parse(name, D, R)
    G, n_tiles, n_tail, NR, H = f.tile_tokens, 3, 11, 2, 4
    T = n_tiles * G + n_tail
    ws = np.zeros(_lib.mla_workspace_bytes(f, D, R, NR, H), np.uint8)
    recs, c, kpe, amag = [], [], [], []
    qmax = 2 ** f.latent_bits - 1
    for i in range(n_tiles):
        lat, rope = latent_like(rng, G, i * G, D, R)
        rec = np.zeros(_lib.mla_record_bytes(f, D, R), np.uint8)
        _lib.mla_encode(f, D, R, ptr(lat), ptr(rope) if R else 0, ptr(ws), ptr(rec))
        dl, dr = np.zeros((G, D), np.float32), np.zeros((G, R), np.float32)
        _lib.mla_decode(f, D, R, ptr(rec), ptr(dl), ptr(dr) if R else 0)
        # encode -> decode: per token within sqrt(sum_d e_d^2) of the RTN
        # half step and the fp16 roundings (tests/codec/test_mla_record.c
        # derives it), plus two fp32 rotations
        a, b, s = fields(rec, f, D)
        e = s[:, None] * (np.abs(a)[None, :] / 2 + 2.0 ** -9 * (qmax * np.abs(a) + np.abs(b))[None, :])
        err = np.linalg.norm(dl.astype(np.float64) - lat, axis=1)
        bound = np.linalg.norm(e, axis=1) + 2 * (math.log2(D) + 2) * U * np.linalg.norm(lat, axis=1) * 1.01
        assert np.all(err <= bound)
        recs.append(rec)
        c.append(dl.astype(np.float64))
        kpe.append(dr.astype(np.float64))
        amag.append(np.linalg.norm(s[:, None] * (qmax * np.abs(a) + np.abs(b))[None, :], axis=1))
    tl, tr = latent_like(rng, n_tail, n_tiles * G, D, R)
    c.append(tl.astype(np.float64))
    kpe.append(tr.astype(np.float64))
    amag.append(np.linalg.norm(tl.astype(np.float64), axis=1))
    c, kpe, amag = np.concatenate(c), np.concatenate(kpe), np.concatenate(amag)
    q = rng.standard_normal((NR, H, D)).astype(np.float32)
    qpe = rng.standard_normal((NR, H, R)).astype(np.float32)
    row_len = np.array([T - 1, T], np.int32)  # one draft row
    scale = 1.0 / math.sqrt(D + R)
    out = np.full((NR, H, D), np.nan, np.float32)
    lse = np.full((NR, H), np.nan, np.float32)
    _lib.mla_attn(f, D, R, [r.ctypes.data for r in recs], ptr(tl), ptr(tr) if R else 0, n_tail,
                  ptr(q), ptr(qpe) if R else 0, NR, H, ptr(row_len), scale, ptr(out), ptr(lse), ptr(ws))
    lg = math.log2(D)
    for i in range(NR):
        n = row_len[i]
        for h in range(H):
            qq, qp = q[i, h].astype(np.float64), qpe[i, h].astype(np.float64)
            sc = (c[:n] @ qq + kpe[:n] @ qp) * scale
            p = np.exp(sc - sc.max())
            l = p.sum()
            p /= l
            ref = p @ c[:n]
            # tests/attn/test_mla_attn.c reference(): the derived bound
            delta = scale * U * ((D + 3 * lg + 16) * np.linalg.norm(qq) * amag[:n]
                                 + (R + 4) * np.linalg.norm(qp) * np.linalg.norm(kpe[:n], axis=1))
            dmax = delta.max()
            chunks = (n + G - 1) // G + 1
            eo = 1.001 * ((math.exp(2 * dmax) - 1) * (p @ np.linalg.norm(c[:n], axis=1))
                          + U * (n + D + 3 * lg + 4 * chunks + 16) * (p @ amag[:n]))
            assert np.linalg.norm(out[i, h] - ref) <= eo
            rl = sc.max() + math.log(l)
            assert abs(lse[i, h] - rl) <= 1.001 * (dmax + U * (n + 8) * (1 + abs(rl)))
    # NaN in a query: the library's reason as the exception, out untouched
    q[1, 2, 5] = np.nan
    keep = out.copy()
    with pytest.raises(_lib.KvarnError) as ei:
        _lib.mla_attn(f, D, R, [r.ctypes.data for r in recs], ptr(tl), ptr(tr) if R else 0, n_tail,
                      ptr(q), ptr(qpe) if R else 0, NR, H, ptr(row_len), scale, ptr(out), 0, ptr(ws))
    assert ei.value.status == -4  # KVARN_ERR_NONFINITE
    assert np.array_equal(out, keep)
