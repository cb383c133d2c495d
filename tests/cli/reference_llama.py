"""reference_llama.py -- an independent numpy forward pass of a llama GGUF.

This is the oracle for the C runner (src/model). It shares nothing with the
C code: tensors are read and dequantized by PyPI's `gguf` package
(GGUFReader, gguf.quants.dequantize), all math is float64, and RoPE is done
the way the original (Hugging Face) checkpoint does it: the GGUF converter
permutes the rows of attn_q / attn_k so that llama.cpp can rotate adjacent
pairs (2i, 2i+1); here the permutation is undone and the "rotate half" form
(pairs (i, i + D/2)) is applied instead. Both give the same attention scores,
so agreement with the C runner checks the C RoPE convention too.

Usage as a module:
    ref = LlamaReference(path)
    logits = ref.forward(token_ids)       # [n_tokens, vocab], float64
    ref16 = LlamaReference(path, bf16=True)
bf16=True models the C runner's bf16 weights (docs/model.md "Weight
precision"): every weight matrix (not the norm vectors) rounded to bf16, and
every matmul's input activations rounded to bf16 (round to nearest even
from float32, as kvarn_fp32_to_bf16), products and sums still float64.
Usage from the command line (writes float32 logits to a .npy file):
    python3 reference_llama.py MODEL.gguf OUT.npy ID ID ID ...
"""
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def round_bf16(x):
    """x (any float array) to float32, then to bf16 by round to nearest
    even, returned as float64. NaN/Inf do not occur in these tensors."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


class LlamaReference:
    def __init__(self, path, bf16=False):
        self.bf16 = bf16
        r = GGUFReader(path)
        arch = _field(r, "general.architecture")
        if arch != "llama":
            raise ValueError(f"not a llama GGUF: {arch}")
        self.n_layers = int(_field(r, "llama.block_count"))
        self.hidden = int(_field(r, "llama.embedding_length"))
        self.n_heads = int(_field(r, "llama.attention.head_count"))
        self.n_kv_heads = int(_field(r, "llama.attention.head_count_kv", self.n_heads))
        self.head_dim = self.hidden // self.n_heads
        self.rope_dim = int(_field(r, "llama.rope.dimension_count", self.head_dim))
        self.theta = float(_field(r, "llama.rope.freq_base", 10000.0))
        self.eps = float(_field(r, "llama.attention.layer_norm_rms_epsilon", 1e-5))
        self.t = {}
        for ten in r.tensors:
            w = dequantize(ten.data, ten.tensor_type).astype(np.float64)
            # GGUF shape is [ne0, ne1, ...] with ne0 fastest; numpy rows = ne1.
            shape = [int(x) for x in reversed(list(ten.shape))]
            self.t[ten.name] = w.reshape(shape)
            if bf16 and len(shape) == 2 and shape[0] > 1:
                self.t[ten.name] = round_bf16(self.t[ten.name])
        self.vocab = self.t["token_embd.weight"].shape[0]
        self.out_w = self.t.get("output.weight", self.t["token_embd.weight"])
        # Undo the converter's row permutation of Q and K (per head: GGUF row
        # 2i + j holds the original row j * D/2 + i).
        for l in range(self.n_layers):
            for name, nh in (("attn_q", self.n_heads), ("attn_k", self.n_kv_heads)):
                key = f"blk.{l}.{name}.weight"
                w = self.t[key]
                d = self.head_dim
                self.t[key] = (w.reshape(nh, d // 2, 2, -1).swapaxes(1, 2)
                               .reshape(w.shape))

    def _in(self, x):
        # A matmul's input: rounded to bf16 in the bf16 model.
        return round_bf16(x) if self.bf16 else x

    def _rms(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def _rope_half(self, x, pos):
        # x [n, heads, D]; rotate pairs (i, i + D/2) by pos * theta^(-2i/D).
        d = self.head_dim
        half = d // 2
        inv = self.theta ** (-np.arange(half, dtype=np.float64) * 2.0 / d)
        ang = pos[:, None].astype(np.float64) * inv[None, :]
        c = np.cos(ang)[:, None, :]
        s = np.sin(ang)[:, None, :]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)

    def forward(self, ids):
        ids = np.asarray(ids, dtype=np.int64)
        n = len(ids)
        H, Hk, D = self.n_heads, self.n_kv_heads, self.head_dim
        grp = H // Hk
        pos = np.arange(n)
        x = self.t["token_embd.weight"][ids]
        mask = np.triu(np.full((n, n), -np.inf), k=1)
        for l in range(self.n_layers):
            p = f"blk.{l}."
            h = self._in(self._rms(x, self.t[p + "attn_norm.weight"]))
            q = (h @ self.t[p + "attn_q.weight"].T).reshape(n, H, D)
            k = (h @ self.t[p + "attn_k.weight"].T).reshape(n, Hk, D)
            v = (h @ self.t[p + "attn_v.weight"].T).reshape(n, Hk, D)
            q = self._rope_half(q, pos)
            k = self._rope_half(k, pos)
            o = np.empty((n, H, D))
            for hh in range(H):
                kh = hh // grp
                s = q[:, hh, :] @ k[:, kh, :].T / np.sqrt(D) + mask
                s -= s.max(axis=1, keepdims=True)
                pr = np.exp(s)
                pr /= pr.sum(axis=1, keepdims=True)
                o[:, hh, :] = pr @ v[:, kh, :]
            x = x + self._in(o.reshape(n, H * D)) @ self.t[p + "attn_output.weight"].T
            h = self._in(self._rms(x, self.t[p + "ffn_norm.weight"]))
            g = h @ self.t[p + "ffn_gate.weight"].T
            u = h @ self.t[p + "ffn_up.weight"].T
            a = g / (1.0 + np.exp(-g)) * u
            x = x + self._in(a) @ self.t[p + "ffn_down.weight"].T
        x = self._in(self._rms(x, self.t["output_norm.weight"]))
        return x @ self.out_w.T


def main(argv):
    if len(argv) < 4:
        print(__doc__)
        return 2
    ref = LlamaReference(argv[1])
    logits = ref.forward([int(a) for a in argv[3:]])
    np.save(argv[2], logits.astype(np.float32))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
