"""Mean-centred KVarN and the error-minimizing RTN range on model K/V
(issue 24): for each model, format and range, the mean KL(P_exact ||
P_codec) over the prompt positions whose queries read quantized tiles
(tests/vllm/emulate.py: transformers in fp32, K/V of every 128-token tile
after the sink through libkvarn's kvarn_encode/kvarn_decode, the plug-in's
read rule), and the per-tile relative RMS error of V and of K on those
models' own K/V: RMS(X - X') / RMS(X - per-channel tile mean of X), the
measure of tests/codec/test_biased_values.c, averaged over every quantized
tile of every layer and KV head; "V mean err": the RMS over channels of
the tile mean of V's error on the same scale (the part of the error the
tile's tokens share, which attention does not average away).

    PYTHONPATH=python:tests/vllm KVARN_LIBRARY=build/libkvarn.so \\
        .venv-vllm/bin/python bench/centred_families.py [--families qwen2,llama3]
        [--model HF_DIR --text FILE] [--tokens 2048] [--prompts 2]
        [--split | --parts kv,k,v] [--sweep layers|heads|heads@SEL]
        [--variants FORMAT/RANGE[/MOD...],...]

--families: random-weight models of tests/vllm/make_models.py (written
under --out, default /tmp/kvarn-families), prompts of uniform random ids;
--model/--text instead: a transformers checkpoint on --prompts windows of
--tokens tokens of the text, window i starting at i/prompts of the
tokenized text. --parts: one KL column per entry, kv (both halves through
the codec), k (only K, V exact), v (only V); --split is kv,k,v.
--variants (default: both kvarn_k4v2_g128 and kvarn_k4v2_g128c with each
range) names what is measured (Variant below): RANGE minmax, mse or msev,
then modifiers: +k / +v centre K / V around the codec in the original
basis (emulated: no K-centred format exists; each costs 2D bytes a
record, counted in the bytes), bN sets balance_iters, refit / sdB / vch
change V's encoding, FMT@SEL a per-layer (or per-KV-head) format map,
only@SEL the sensitivity of SEL alone. --sweep repeats each variant once
per layer (or KV head) with only that one through the codec. B/token:
record bytes a token over every layer and KV head; B/token/head: their
mean. OMP_NUM_THREADS sets torch's threads.
"""
import argparse
import ctypes
import os
import sys

import numpy as np

import emulate
import make_models
from kvarn_vllm import _lib

RANGES = {"minmax": emulate.RTN_MINMAX, "mse": emulate.RTN_MSE, "msev": emulate.RTN_MSE_V}
DEFAULT = ",".join(f"{f}/{r}" for f in ("kvarn_k4v2_g128", "kvarn_k4v2_g128c") for r in RANGES)


class RecordLayout(ctypes.Structure):
    """include/kvarn/record.h: kvarn_record_layout."""
    _fields_ = ([(n, ctypes.c_int) for n in ("head_dim", "tile_tokens", "key_bits", "value_bits")]
                + [(n + s, ctypes.c_size_t) for n in ("k_codes", "k_a", "k_b", "k_stok", "v_codes",
                                                       "v_schan", "v_a", "v_b", "v_mu")
                   for s in ("_off", "_bytes")]
                + [("payload_bytes", ctypes.c_size_t), ("record_bytes", ctypes.c_size_t)])


def _layout(fmt, D):
    L = _lib.lib()
    L.kvarn_record_layout_get.restype = ctypes.c_int
    L.kvarn_record_layout_get.argtypes = [ctypes.POINTER(_lib.Format), ctypes.c_int,
                                          ctypes.POINTER(RecordLayout)]
    out = RecordLayout()
    _lib.check(L.kvarn_record_layout_get(ctypes.byref(fmt), D, ctypes.byref(out)),
               "kvarn_record_layout_get")
    return out


def _rotate(x):
    """x [n, D] -> x H / sqrt(D) (the codec's rotation, its own inverse)."""
    x = np.array(x, dtype=np.float32, order="C")
    emulate._codec_lib().kvarn_hadamard_rows(x.ctypes.data, x.shape[0], x.shape[1])
    return x


def _rel(x, y):
    c = x - x.mean(axis=0, keepdims=True)
    return float(np.sqrt(np.mean((x - y) ** 2) / max(np.mean(c * c), 1e-30)))


def _rel_mean(x, y):
    """RMS over channels of the tile mean of the error, over the RMS of the
    centred x: the part of the error shared by the tile's tokens, which an
    attention spread over them does not average away."""
    c = x - x.mean(axis=0, keepdims=True)
    return float(np.sqrt(np.mean((x - y).mean(axis=0) ** 2) / max(np.mean(c * c), 1e-30)))


def _fp16_mean(x):
    return x.mean(axis=0, keepdims=True).astype(np.float16).astype(np.float32)


def _sel(text):
    """"0+3-5+7.1" -> {(0, None), (3, None), (4, None), (5, None), (7, 1)}:
    layers (all their KV heads) or layer.head."""
    out = set()
    for item in text.split("+"):
        if "." in item:
            l, h = item.split(".")
            out.add((int(l), int(h)))
        elif "-" in item:
            a, b = item.split("-")
            out.update((l, None) for l in range(int(a), int(b) + 1))
        else:
            out.add((int(item), None))
    return frozenset(out)


def _in(sel, layer, head):
    return (layer, None) in sel or (layer, head) in sel


class Variant:
    """FORMAT/RANGE[/MOD...]: a format and a range (minmax, mse, msev:
    kvarn_codec_opts.rtn_range), then any of
      +k / +v    the per-channel fp16 means of the tile's K / V (original
                 basis) subtracted before kvarn_encode and added after
                 kvarn_decode (emulated centring; +v on a "c" format:
                 nothing left for the format to centre);
      bN         balance_iters N (default 8);
      refit      centred formats: after kvarn_encode, the record's mu_d is
                 replaced by fp16(mu_d + the tile mean over tokens of the
                 rotated V minus its decode), so V's tile-mean error is 0
                 up to fp16 (an encoder-only change: same layout);
      sdB        V's codes chosen again from the record's own scales with
                 error feedback along the tile's tokens (per channel, leak
                 B, carried error clipped to one code step of the row):
                 encoder-only, same layout;
      vch        V's RTN rows are channels (V through the K path of
                 kvarn_k{vb}v{vb}_g{G}: a_d, b_d per channel, s_tok per
                 token; emulated, no such format: V's metadata 4D + 2G
                 bytes a record instead of 2D + 4G);
      FMT@SEL    the layers / KV heads in SEL (0+3-5+7.1: layers 0, 3..5,
                 head 1 of layer 7) use format FMT instead (same range and
                 modifiers; a per-layer format map);
      only@SEL   only SEL goes through the codec, every other layer and
                 head stays exact (sensitivity sweeps)."""

    def __init__(self, spec):
        f = spec.split("/")
        self.spec, self.fmt, self.rtn = spec, f[0], RANGES[f[1]]
        self.centre = "".join(x[1] for x in f[2:] if x.startswith("+"))
        self.iters = next((int(x[1:]) for x in f[2:] if x[0] == "b" and x[1:].isdigit()), 8)
        self.refit = "refit" in f[2:]
        self.sd = next((float(x[2:]) for x in f[2:] if x.startswith("sd")), None)
        self.vch = "vch" in f[2:]
        self.only = next((_sel(x[5:]) for x in f[2:] if x.startswith("only@")), None)
        self.over = [(x.split("@")[0], _sel(x.split("@")[1])) for x in f[2:]
                     if "@" in x and not x.startswith("only@")]

    def fmt_at(self, layer, head):
        for fmt, sel in self.over:
            if _in(sel, layer, head):
                return fmt
        return self.fmt

    def quantized(self, layer, head):
        return self.only is None or _in(self.only, layer, head)

    def key(self, parts):
        """What the KL of parts ("kv", "k": K through the codec, V exact,
        "v") depends on: K's path is the same for every value format, for
        min/max and msev, and for the V-only modifiers."""
        bits = lambda name: _lib.parse_format(name).key_bits
        if parts == "k":
            return ("k", self.rtn == emulate.RTN_MSE, "k" in self.centre, self.iters, self.only,
                    bits(self.fmt), tuple((bits(f), s) for f, s in self.over))
        if parts == "v":
            vf = lambda name: name.split("_")[1][2:] + name.split("_")[2]
            return ("v", vf(self.fmt), tuple((vf(f), s) for f, s in self.over),
                    self.rtn != emulate.RTN_MINMAX, "v" in self.centre, self.iters, self.refit,
                    self.sd, self.vch, self.only)
        return self.spec

    def bytes_per_token(self, D, n_layers, n_heads):
        """Record bytes a token over every layer and KV head (emulated
        extras included)."""
        total = 0.0
        for l in range(n_layers):
            for h in range(n_heads):
                name = self.fmt_at(l, h)
                fmt = _lib.parse_format(name, D)
                G = fmt.tile_tokens
                b = _lib.record_bytes(fmt, D) / G
                b += 2 * D / G * len(self.centre.replace("v", "" if name.endswith("c") else "v"))
                if self.vch:   # V metadata 4D + 2G instead of 2D + 4G (before padding)
                    b += (2 * D - 2 * G) / G
                total += b
        return total


class Probe:
    """A Codec (emulate.logprobs(codec=...)) for one Variant that records
    each tile's rel-RMS error of K and V and passes through the codec's K
    and V where parts says so, the exact ones elsewhere."""

    def __init__(self, var, parts):
        self.var, self.parts = var, parts
        self.err_k, self.err_v, self.err_vm = [], [], []
        self.where = (0, 0)

    def __call__(self, head_dim):
        self.D, self.codecs, self.layouts = head_dim, {}, {}
        self.G = self._codec(self.var.fmt).G
        return self

    def layer_quantized(self, layer):
        v = self.var
        return v.only is None or any(l == layer for l, _ in v.only)

    def _codec(self, name):
        if name not in self.codecs:
            c = emulate.Codec(name, self.D, self.var.rtn)
            c.opts.balance_iters = self.var.iters
            self.codecs[name] = c
            self.layouts[name] = _layout(c.fmt, self.D)
        return self.codecs[name]

    def _fp16(self, c, off, n):
        return c.rec[off: off + 2 * n].view(np.float16)

    def _refit(self, c, lay, v):
        """Rewrite mu_d so that the tile mean of V's error is 0 (rotated basis)."""
        assert lay.v_mu_bytes, f"refit needs a centred format, not {c.fmt.name}"
        _, vo = c.decode(rotated=True)
        delta = (_rotate(v).astype(np.float64) - vo).mean(axis=0)
        mu = self._fp16(c, lay.v_mu_off, self.D)
        mu[:] = (mu.astype(np.float64) + delta).astype(np.float16)

    def _sigma_delta(self, c, lay, v, leak):
        """V's codes again from the record's s_chan, a_t, b_t (and mu_d),
        token by token, each token's target plus the carried error of the
        previous ones (per channel), codes packed back."""
        D, G, vb = self.D, self.G, lay.value_bits
        s = self._fp16(c, lay.v_schan_off, D).astype(np.float32)
        a = self._fp16(c, lay.v_a_off, G).astype(np.float32)
        b = self._fp16(c, lay.v_b_off, G).astype(np.float32)
        mu = (self._fp16(c, lay.v_mu_off, D).astype(np.float32) if lay.v_mu_bytes
              else np.zeros(D, np.float32))
        r = _rotate(v) - mu
        qmax = (1 << vb) - 1
        codes = np.zeros((G, D), dtype=np.uint8)
        e = np.zeros(D, np.float32)
        for t in range(G):
            u = r[t] + e
            if a[t] > 0:
                q = np.clip(np.rint((u / s - b[t]) / a[t]), 0, qmax)
            else:
                q = np.zeros(D)
            dec = (q.astype(np.float32) * a[t] + b[t]) * s
            step = a[t] * s
            e = np.clip(leak * (u - dec), -step, step)
            codes[t] = q
        per = 8 // vb
        packed = np.zeros((G, D // per), dtype=np.uint8)
        for i in range(per):
            packed |= (codes[:, i::per] << (i * vb)).astype(np.uint8)
        c.rec[lay.v_codes_off: lay.v_codes_off + G * D // per] = packed.reshape(-1)

    def roundtrip(self, k, v):
        var = self.var
        layer, head = self.where
        if not var.quantized(layer, head):
            return k, v
        name = var.fmt_at(layer, head)
        c = self._codec(name)
        lay = self.layouts[name]
        mk = _fp16_mean(k) if "k" in var.centre else 0.0
        mv = _fp16_mean(v) if "v" in var.centre else 0.0
        c.encode(k - mk, v - mv)
        if var.refit:
            self._refit(c, lay, v - mv)
        if var.sd is not None:
            self._sigma_delta(c, lay, v - mv, var.sd)
        ko, vo = c.decode()
        if var.vch:
            vb, G = lay.value_bits, self.G
            cv = self._codec(f"kvarn_k{vb}v{vb}_g{G}")
            cv.encode(v - mv, v - mv)
            vo, _ = cv.decode()
        ko, vo = ko + mk, vo + mv
        self.err_k.append(_rel(k, ko))
        self.err_v.append(_rel(v, vo))
        self.err_vm.append(_rel_mean(v, vo))
        return (ko if "k" in self.parts else k), (vo if "v" in self.parts else v)


def _prompts(args):
    """--prompts windows of --tokens ids, window i starting at i / prompts
    of the tokenized text (1: its first --tokens ids; 2: also the ones from
    its middle)."""
    if args.model:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.model)
        ids = tok(open(args.text, encoding="utf-8").read())["input_ids"]
        step = len(ids) // args.prompts
        return [ids[i * step: i * step + args.tokens] for i in range(args.prompts)]
    rng = np.random.default_rng(1)
    return [[int(x) for x in rng.integers(3, make_models.VOCAB, args.tokens)]
            for _ in range(args.prompts)]


def _sweep(variants, how, n_layers, n_heads):
    """--sweep layers | heads[@SEL]: each variant once per layer (or per KV
    head of the layers in SEL, default all) with only that one quantized."""
    if not how:
        return variants
    if how == "layers":
        sels = [str(l) for l in range(n_layers)]
    else:
        layers = sorted(l for l, _ in _sel(how[6:])) if how.startswith("heads@") else range(n_layers)
        sels = [f"{l}.{h}" for l in layers for h in range(n_heads)]
    return [Variant(f"{v.spec}/only@{s}") for v in variants for s in sels]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default="qwen2,llama3")
    ap.add_argument("--out", default="/tmp/kvarn-families")
    ap.add_argument("--model")
    ap.add_argument("--text")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--split", action="store_true", help="--parts kv,k,v")
    ap.add_argument("--parts", default="kv",
                    help="which halves go through the codec, one KL column each: kv, k, v")
    ap.add_argument("--sweep", default="", help="layers | heads | heads@SEL")
    ap.add_argument("--variants", default=DEFAULT)
    args = ap.parse_args()
    import torch
    import transformers
    from transformers import AutoConfig
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    transformers.utils.logging.disable_progress_bar()
    if args.model and not args.text:
        sys.exit("centred_families: --model needs --text")
    parts = ("kv", "k", "v") if args.split else tuple(args.parts.split(","))
    models = ([args.model] if args.model else
              [make_models.make(f, args.out) for f in args.families.split(",")])
    prompts = _prompts(args)
    G = 128
    read_from = (emulate.SINK_TILES + 1) * G
    names = {"kv": "KL mean", "k": "KL K only", "v": "KL V only"}
    cols = ("| model | variant | B/token | B/token/head |"
            + "".join(f" {names[p]} |" for p in parts)
            + " V rel-RMS | V mean err | K rel-RMS |")
    print(cols)
    print("|" + "---|" * (cols.count("|") - 1), flush=True)
    for model in models:
        exact = [emulate.logprobs(model, p, quantize=False) for p in prompts]
        cfg = AutoConfig.from_pretrained(model).get_text_config()
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        n_layers, n_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
        variants = _sweep([Variant(v) for v in args.variants.split(",")], args.sweep,
                          n_layers, n_heads)
        done = {}
        for var in variants:
            for part in parts:
                if var.key(part) in done:
                    continue
                probe = Probe(var, part)
                kls = [emulate.kl_rows(e, emulate.logprobs(model, p, quantize=True, codec=probe))
                       [read_from:] for e, p in zip(exact, prompts)]
                done[var.key(part)] = (float(np.mean(np.concatenate(kls))), np.mean(probe.err_v),
                                       np.mean(probe.err_vm), np.mean(probe.err_k))
            _, ev, evm, ek = done[var.key(parts[0])]
            bpt = var.bytes_per_token(D, n_layers, n_heads)
            row = (f"| {os.path.basename(model)} | {var.spec} | {bpt:.1f} | "
                   f"{bpt / (n_layers * n_heads):.2f} |"
                   + "".join(f" {done[var.key(p)][0]:.5f} |" for p in parts)
                   + f" {ev:.3f} | {evm:.4f} | {ek:.3f} |")
            print(row, flush=True)

if __name__ == "__main__":
    main()
