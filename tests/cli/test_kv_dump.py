"""test_kv_dump.py -- `kvarn eval --dump-kv` (docs/kv-dump.md) on the real
SmolLM2-135M model: the header, the file size, and the dumped K/V of the
first layers against the numpy reference (reference_llama.py).

What is compared, and why: the numpy reference undoes the GGUF converter's
row permutation of attn_k and applies "rotate half" RoPE (pairs (i, i+D/2));
the C runner keeps the GGUF's permuted rows and rotates adjacent pairs
(2i, 2i+1). The two K differ only by that channel permutation within each
head: C channel 2i + j holds reference channel j*D/2 + i. So V is compared
directly and K after permuting the reference's channels the same way. The
token ids come from the independent HF tokenizer of conftest.py (fixture
hf), with BOS added when the GGUF asks for it, as kvarn eval does; a
tokenizer mismatch would show as a failure of the V comparison.
Tolerance: max |diff| <= 1e-3 * max |ref| per layer and tensor (C computes
in fp32, numpy in float64, from the same dequantized weights; from layer 1
on the reference session's second chunk also saw its history at fp16).
Measured: layer 0 K 4.5e-6, V 3.1e-7; layer 1 K 2.9e-4 (of 15.7), V 6.3e-5.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

CTX = 256
LAYERS = 2
TEXT = (
    "It was a bright cold day in April, and the clocks in the old town were "
    "striking thirteen. The baker opened his shop early, as he always did, and "
    "the smell of fresh bread drifted down the narrow street towards the river. "
    "Children ran past the fountain on their way to school, arguing about a "
    "game they had played the evening before. Nobody noticed the stranger who "
    "sat on the bench by the church, reading a letter for the third time. "
) * 6


def _kv_reference(ref, ids, n_layers):
    """float64 K (post-RoPE, reference channel order) and V of the first
    n_layers layers: lists of [n, Hk, D]."""
    n = len(ids)
    H, Hk, D = ref.n_heads, ref.n_kv_heads, ref.head_dim
    grp = H // Hk
    pos = np.arange(n)
    x = ref.t["token_embd.weight"][np.asarray(ids, dtype=np.int64)]
    mask = np.triu(np.full((n, n), -np.inf), k=1)
    ks, vs = [], []
    for l in range(n_layers):
        p = f"blk.{l}."
        h = ref._rms(x, ref.t[p + "attn_norm.weight"])
        q = (h @ ref.t[p + "attn_q.weight"].T).reshape(n, H, D)
        k = (h @ ref.t[p + "attn_k.weight"].T).reshape(n, Hk, D)
        v = (h @ ref.t[p + "attn_v.weight"].T).reshape(n, Hk, D)
        q = ref._rope_half(q, pos)
        k = ref._rope_half(k, pos)
        ks.append(k)
        vs.append(v)
        if l + 1 == n_layers:
            break
        o = np.empty((n, H, D))
        for hh in range(H):
            s = q[:, hh, :] @ k[:, hh // grp, :].T / np.sqrt(D) + mask
            s -= s.max(axis=1, keepdims=True)
            pr = np.exp(s)
            pr /= pr.sum(axis=1, keepdims=True)
            o[:, hh, :] = pr @ v[:, hh // grp, :]
        x = x + o.reshape(n, H * D) @ ref.t[p + "attn_output.weight"].T
        h = ref._rms(x, ref.t[p + "ffn_norm.weight"])
        g = h @ ref.t[p + "ffn_gate.weight"].T
        u = h @ ref.t[p + "ffn_up.weight"].T
        x = x + (g / (1.0 + np.exp(-g)) * u) @ ref.t[p + "ffn_down.weight"].T
    return ks, vs


def _token_ids(hf, model_path, text):
    from gguf import GGUFReader
    r = GGUFReader(model_path)
    ids = hf.encode(text).ids
    f = r.fields.get("tokenizer.ggml.add_bos_token")
    if f is not None and bool(f.contents()):
        ids = [int(r.fields["tokenizer.ggml.bos_token_id"].contents())] + ids
    return ids


def test_dump_kv_matches_reference(kvarn_bin, model_path, hf, tmp_path):
    from reference_llama import LlamaReference
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    dump = tmp_path / "kv.bin"
    subprocess.run([kvarn_bin, "eval", "-m", model_path, "-f", str(text), "--ctx", str(CTX),
                    "--kv-cache-dtype", "int8", "--decode-tokens", "2",
                    "--dump-kv", str(dump), "--dump-layers", str(LAYERS)],
                   check=True, stdout=subprocess.DEVNULL)
    raw = dump.read_bytes()
    assert raw[:8] == b"KVDUMP1\0"
    version, L, T, Hk, D, dtype, flags = np.frombuffer(raw[8:36], dtype="<u4")
    assert (version, L, T, dtype, flags) == (1, LAYERS, CTX, 0, 1)
    assert raw[36:64] == bytes(28)
    ref = LlamaReference(model_path)
    assert (Hk, D) == (ref.n_kv_heads, ref.head_dim)
    size = int(L) * int(T) * int(Hk) * int(D)
    assert len(raw) == 64 + 2 * 4 * size
    data = np.frombuffer(raw[64:], dtype="<f4")
    k_c = data[:size].reshape(L, T, Hk, D)
    v_c = data[size:].reshape(L, T, Hk, D)

    ids = _token_ids(hf, model_path, TEXT)
    assert len(ids) >= CTX
    ks, vs = _kv_reference(ref, ids[:CTX], LAYERS)
    for l in range(LAYERS):
        # reference channel j*D/2 + i -> C channel 2i + j
        k_perm = ks[l].reshape(CTX, Hk, 2, D // 2).swapaxes(2, 3).reshape(CTX, Hk, D)
        for name, c, r in (("K", k_c[l], k_perm), ("V", v_c[l], vs[l])):
            err = np.abs(c.astype(np.float64) - r).max()
            scale = np.abs(r).max()
            print(f"layer {l} {name}: max|diff| {err:.3e} (max|ref| {scale:.2f})")
            assert scale > 0.1
            assert err <= 1e-3 * scale


def test_dump_kv_bad_layers(kvarn_bin, model_path, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    r = subprocess.run([kvarn_bin, "eval", "-m", model_path, "-f", str(text), "--ctx", "64",
                        "--dump-kv", str(tmp_path / "x.bin"), "--dump-layers", "0"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "--dump-layers" in r.stderr
