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
        [--model HF_DIR --text FILE] [--tokens 2048] [--prompts 2] [--split]
        [--variants FORMAT/RANGE[/+k][/+v][/bN],...]

--families: random-weight models of tests/vllm/make_models.py (written
under --out, default /tmp/kvarn-families), prompts of uniform random ids;
--model/--text instead: a transformers checkpoint on --prompts windows of
--tokens tokens of the text. --split adds the KL with only K through the
codec (V exact) and with only V (K exact). --variants (default: both
kvarn_k4v2_g128 and kvarn_k4v2_g128c with each range) names what is
measured (Variant below): RANGE minmax, mse or msev; +k / +v centre K / V
around the codec in the original basis (emulated: no K-centred format
exists; each costs 2D bytes a record, counted in B/token/head); bN sets
balance_iters.
"""
import argparse
import os
import sys

import numpy as np

import emulate
import make_models
from kvarn_vllm import _lib

RANGES = {"minmax": emulate.RTN_MINMAX, "mse": emulate.RTN_MSE, "msev": emulate.RTN_MSE_V}
DEFAULT = ",".join(f"{f}/{r}" for f in ("kvarn_k4v2_g128", "kvarn_k4v2_g128c") for r in RANGES)


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


class Variant:
    """FORMAT/RANGE[/+k][/+v][/bN]: a format, a range (minmax, mse, msev:
    kvarn_codec_opts.rtn_range), +k / +v: the per-channel fp16 means of the
    tile's K / V (original basis) subtracted before kvarn_encode and added
    after kvarn_decode (emulated centring; +v on a "c" format: nothing left
    for the format to centre), bN: balance_iters N (default 8)."""

    def __init__(self, spec):
        f = spec.split("/")
        self.spec, self.fmt, self.rtn = spec, f[0], RANGES[f[1]]
        self.centre = "".join(x[1] for x in f[2:] if x.startswith("+"))
        self.iters = next((int(x[1:]) for x in f[2:] if x.startswith("b")), 8)

    def key(self, parts):
        """What the KL of parts ("kv", "k": K through the codec, V exact,
        "v") depends on: K's path is the same for every format and for
        min/max and msev."""
        if parts == "k":
            return ("k", self.rtn == emulate.RTN_MSE, "k" in self.centre, self.iters)
        if parts == "v":
            return ("v", self.fmt, self.rtn != emulate.RTN_MINMAX, "v" in self.centre, self.iters)
        return self.spec


class Probe:
    """A Codec (emulate.logprobs(codec=...)) for one Variant that records
    each tile's rel-RMS error of K and V and passes through the codec's K
    and V where parts says so, the exact ones elsewhere."""

    def __init__(self, var, parts):
        self.var, self.parts = var, parts
        self.err_k, self.err_v, self.err_vm = [], [], []

    def __call__(self, head_dim):
        self.codec = emulate.Codec(self.var.fmt, head_dim, self.var.rtn)
        self.codec.opts.balance_iters = self.var.iters
        self.G = self.codec.G
        return self

    def roundtrip(self, k, v):
        mk = _fp16_mean(k) if "k" in self.var.centre else 0.0
        mv = _fp16_mean(v) if "v" in self.var.centre else 0.0
        ko, vo = self.codec.roundtrip(k - mk, v - mv)
        ko, vo = ko + mk, vo + mv
        self.err_k.append(_rel(k, ko))
        self.err_v.append(_rel(v, vo))
        self.err_vm.append(_rel_mean(v, vo))
        return (ko if "k" in self.parts else k), (vo if "v" in self.parts else v)


def _prompts(args):
    if args.model:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.model)
        ids = tok(open(args.text, encoding="utf-8").read())["input_ids"]
        step = len(ids) // args.prompts
        return [ids[i * step: i * step + args.tokens] for i in range(args.prompts)]
    rng = np.random.default_rng(1)
    return [[int(x) for x in rng.integers(3, make_models.VOCAB, args.tokens)]
            for _ in range(args.prompts)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default="qwen2,llama3")
    ap.add_argument("--out", default="/tmp/kvarn-families")
    ap.add_argument("--model")
    ap.add_argument("--text")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--split", action="store_true")
    ap.add_argument("--variants", default=DEFAULT)
    args = ap.parse_args()
    import transformers
    from transformers import AutoConfig
    transformers.utils.logging.disable_progress_bar()
    if args.model and not args.text:
        sys.exit("centred_families: --model needs --text")
    models = ([args.model] if args.model else
              [make_models.make(f, args.out) for f in args.families.split(",")])
    variants = [Variant(v) for v in args.variants.split(",")]
    prompts = _prompts(args)
    G = 128
    read_from = (emulate.SINK_TILES + 1) * G
    cols = "| model | variant | B/token/head | KL mean | V rel-RMS | V mean err | K rel-RMS |"
    if args.split:
        cols += " KL K only | KL V only |"
    print(cols)
    print("|" + "---|" * (cols.count("|") - 1), flush=True)
    for model in models:
        exact = [emulate.logprobs(model, p, quantize=False) for p in prompts]
        cfg = AutoConfig.from_pretrained(model).get_text_config()
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        done = {}
        for var in variants:
            for parts in (("kv", "k", "v") if args.split else ("kv",)):
                if var.key(parts) in done:
                    continue
                probe = Probe(var, parts)
                kls = [emulate.kl_rows(e, emulate.logprobs(model, p, quantize=True, codec=probe))
                       [read_from:] for e, p in zip(exact, prompts)]
                done[var.key(parts)] = (float(np.mean(np.concatenate(kls))), np.mean(probe.err_v),
                                        np.mean(probe.err_vm), np.mean(probe.err_k))
            kl, ev, evm, ek = done[var.key("kv")]
            bpt = (_lib.record_bytes(_lib.parse_format(var.fmt, D), D) / G
                   + 2 * D / G * len(var.centre.replace("v", "" if var.fmt.endswith("c") else "v")))
            row = f"| {os.path.basename(model)} | {var.spec} | {bpt:.2f} | {kl:.5f} | {ev:.3f} | {evm:.4f} | {ek:.3f} |"
            if args.split:
                row += f" {done[var.key('k')][0]:.5f} | {done[var.key('v')][0]:.5f} |"
            print(row, flush=True)

if __name__ == "__main__":
    main()
