"""The report as text: the table printed on stdout, and the lines for
value-biased models (plain against mean-centred KVarN) and for models
with sliding-window layers."""
import os

from .common import PROG
from .score import FOLD_TOP, FORMAT_TOP


def _f(v, fmt: str, none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def table(report: dict) -> str:
    """The plain table printed on stdout (the header lines, then one row per
    format; refused formats last, with the reason)."""
    r = report
    lines = []
    kld = ("exact (every vocabulary entry)" if r["kld_mode"] == "exact" else
           f"folded: the reference's top {FOLD_TOP} tokens (those in the format's top "
           f"{FORMAT_TOP}), the rest one bucket (vLLM returns top-k log-probs only; a lower "
           f"bound of the exact KLD)")
    lines.append(f"{PROG}: {r['model']} ({r['model_dtype']}, vocabulary {r['vocab']}) | text "
                 f"{r['text']} | {r['windows']} window(s) x "
                 f"{r['ctx']} tokens, prompt positions [0, {r['ctx'] - r['decode']}), the last "
                 f"{r['decode']} as decoded | vLLM {r['vllm_version']}")
    lines.append(f"reference: auto, vLLM's unquantized cache ({r['model_dtype']}); KLD {kld}")
    pool = "MLA tail pool" if r.get("mla") else "staging pool"
    if r.get("mla"):
        by = {}
        for f in r["formats"]:
            for b in f.get("attention_backends") or []:
                by.setdefault(b, []).append(f["label"])
        used = "; ".join(f"{b}: {', '.join(labs)}" for b, labs in sorted(by.items()))
        how = (f"the last {r['decode']} tokens of each window decoded one step at a time, "
               f"each step's token forced to the text's (raw log-probabilities)"
               if r.get("decode_mode") == "forced" else "no position decoded (--decode 0)")
        lines.append(f"MLA model: vLLM runs a prompt as MHA on the fresh latents, so the prompt "
                     f"columns read no cache (KLD ~0 for every format); {how}; attention "
                     f"backends: {used or '-'}")
    mns = (f"max_num_seqs {r['max_num_seqs']}" if r["max_num_seqs"] else
           f"max_num_seqs per format: the most {r['ctx']}-token requests that fit with the "
           f"{pool} sized for them")
    lines.append(f"capacity: vLLM's figures for a KV budget of {r['budget_bytes'] / 2**30:.2f} "
                 f"GiB ({pool} counted), {mns}, max_num_batched_tokens "
                 f"{r['max_num_batched_tokens']}; 'fit': requests of {r['ctx']} tokens")
    hdr = ["format", "B/token", "KV tokens", "x ref", "fit", "KLD mean", "median", "p99",
           "top-1", "dec KLD", "dec med", "dec p99", "dec top-1", "PPL (delta)", "s"]
    rows = []
    for f in r["formats"]:
        if f["status"] == "refused":
            continue
        ref = f["status"] == "reference"
        rows.append([
            f["label"] + (" (ref)" if ref else ""),
            _f(f["bytes_per_token"], ".0f"), _f(f["kv_tokens"], "d"), _f(f["x_ref"], ".2f"),
            (_f(f["requests_fit"], "d") + ("+" if f.get("capped") else "")),
            "-" if ref else _f(f["kld_mean"], ".5f"), "-" if ref else _f(f["kld_median"], ".5f"),
            "-" if ref else _f(f["kld_p99"], ".5f"),
            "-" if ref else _pct(f["top1"]),
            "-" if ref else _f(f["decode_kld_mean"], ".5f"),
            "-" if ref else _f(f["decode_kld_median"], ".5f"),
            "-" if ref else _f(f["decode_kld_p99"], ".5f"),
            "-" if ref else _pct(f["decode_top1"]),
            _f(f["ppl"], ".4f") + ("" if ref else f" ({f['ppl_delta']:+.4f})"),
            _f(f["seconds"], ".0f")])
    w = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(hdr)]
    lines.append("  ".join(h.ljust(w[i]) if i == 0 else h.rjust(w[i]) for i, h in enumerate(hdr)))
    for x in rows:
        lines.append("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i])
                               for i, c in enumerate(x)))
    refused = [f for f in r["formats"] if f["status"] == "refused"]
    if refused:
        lines.append("refused on this build (no numbers):")
        for f in refused:
            lines.append(f"  {f['label']}: {f['reason']}")
    if any(f.get("capped") for f in r["formats"]):
        lines.append("+: more would fit; --max-num-seqs caps the requests held")
    partial = [f for f in r["formats"] if f.get("kld_partial") or f.get("decode_kld_partial")]
    for f in partial:
        lines.append(f"{f['label']}: at {f['kld_partial']} prompt and {f['decode_kld_partial']} "
                     f"decode positions the format's top {FORMAT_TOP} lacks some of the "
                     f"reference's top {FOLD_TOP} (folded into the bucket there: a looser bound)")
    lines += r.get("value_bias_notes", [])
    lines += r.get("sliding_window_notes", [])
    return "\n".join(lines)


def sliding_window_notes(report: dict) -> list:
    """Lines for a model that mixes sliding-window and full attention
    layers (report["sliding_layers"], read in the reference's engine), one
    per KVarN row run without a KVARN_SLIDING_WINDOW setting (the default,
    "vllm": the sliding-window layers keep vLLM's own cache): where the same
    format with KVARN_SLIDING_WINDOW=quantize (every layer in records) was
    run too, the KV tokens over the reference's and the KLD (decode column;
    the prompt column where --decode is 0) of both, naming the one that
    holds more unless its KLD is more than twice the other's (the tests'
    rule for one codec on two hosts: beyond it the difference is the
    format's, not noise), then the other; where it was not run, a line
    naming it. Nothing for other models. Returns the lines."""
    ns, n = (report.get("sliding_layers") or [0, 0])[:2]
    if not (0 < ns < n):
        return []
    from .. import _lib
    rows = [f for f in report["formats"] if f["status"] == "ok"]
    model = os.path.basename(os.path.normpath(report["model"]))
    head = f"sliding windows: {model} has {ns} sliding-window layers of {n}"
    out = []
    for p in rows:
        if not _lib.is_kvarn_dtype(p["name"]) or _lib.is_mla_dtype(p["name"]) \
                or "KVARN_SLIDING_WINDOW" in p["env"]:
            continue
        env = dict(p["env"], KVARN_SLIDING_WINDOW="quantize")
        qlabel = ":".join([p["name"]] + [f"{k}={v}" for k, v in env.items()])
        q = next((f for f in rows if f["name"] == p["name"] and f["env"] == env), None)
        if q is None:
            out.append(f"{head}, which {p['label']} keeps in vLLM's own cache "
                       f"({_f(p.get('x_ref'), '.2f')}x the reference's KV tokens); "
                       f"{qlabel} stores them as records too: add it to --kv-cache-dtype to "
                       f"see what it holds and costs")
            continue
        kp, col = _kld_of(p)
        kq, _ = _kld_of(q)
        xp, xq = p.get("x_ref"), q.get("x_ref")
        if None in (kp, kq, xp, xq):
            continue
        both = (f"{q['label']} {xq:.2f}x the reference's KV tokens at {col} {kq:.5f}, "
                f"{p['label']} (sliding-window layers in vLLM's cache) {xp:.2f}x at {kp:.5f}")
        if xq > xp and kq <= 2 * kp:
            out.append(f"{head}; better: {q['label']}: {both}")
        elif xq > xp:
            out.append(f"{head}; better: {p['label']}: {q['label']} holds more but its KLD is "
                       f"more than twice: {both}")
        else:
            out.append(f"{head}; better: {p['label']}: {both}")
    return out


def _kld_of(row: dict) -> tuple:
    """(the KLD a comparison uses, its column's name): the decode column's
    mean, or the prompt column's where no position was decoded."""
    if row.get("decode_kld_mean") is not None:
        return row["decode_kld_mean"], "decode KLD"
    return row.get("kld_mean"), "KLD"


def value_bias_notes(report: dict) -> list:
    """Lines for a model that adds a bias to its values (report
    ["value_bias"]: checks.has_value_bias of the model's text config, read
    in the reference's engine), one per plain KVarN row run (status ok):
    where its mean-centred variant (the same name with a trailing c, the
    same settings) was run too, which of the two has the lower KLD (decode
    column; the prompt column where --decode is 0) and the bytes per token
    of each (the centred record carries the value means: a few percent
    more); where it was not, a line naming the centred format to run (its
    bytes from the C library's record size at the model's head_dim).
    Nothing for a model without value biases. Returns the lines."""
    if not report.get("value_bias"):
        return []
    from .. import _lib
    rows = [f for f in report["formats"] if f["status"] == "ok"]
    model = os.path.basename(os.path.normpath(report["model"]))
    out = []
    for p in rows:
        if not _lib.is_kvarn_dtype(p["name"]) or _lib.is_mla_dtype(p["name"]) \
                or _lib.is_per_token_dtype(p["name"]) or _lib.parse_format(p["name"]).centred:
            continue
        cname = p["name"] + "c"
        c = next((f for f in rows if f["name"] == cname and f["env"] == p["env"]), None)
        clabel = ":".join([cname] + [f"{k}={v}" for k, v in p["env"].items()])
        if c is None:
            d = report.get("head_dim")
            more = ""
            if d:
                rp = _lib.record_bytes(_lib.parse_format(p["name"], d), d)
                rc = _lib.record_bytes(_lib.parse_format(cname, d), d)
                more = f" ({100 * (rc - rp) / rp:+.1f}% bytes per token)"
            out.append(f"value biases: {model} adds a bias to its values, which {p['label']} "
                       f"quantizes with the rest; its mean-centred variant {clabel} stores each "
                       f"tile's value means apart{more}: add it to --kv-cache-dtype to see "
                       f"which wins")
            continue
        kp, col = _kld_of(p)
        kc, _ = _kld_of(c)
        if kp is None or kc is None:
            continue
        bp, bc = p["bytes_per_token"], c["bytes_per_token"]
        size = (f"{bc:.0f} B/token against {bp:.0f} ({100 * (bc - bp) / bp:+.1f}%)"
                if bp and bc else "bytes per token unknown")
        if kc < kp:
            ratio = f"{kp / kc:.1f}x lower" if kc > 0 else "lower"
            out.append(f"value biases: {model} adds a bias to its values; the centred "
                       f"{c['label']} wins over {p['label']}: {col} {kc:.5f} against "
                       f"{kp:.5f} ({ratio}), {size}")
        else:
            out.append(f"value biases: {model} adds a bias to its values, yet the plain "
                       f"{p['label']} wins over the centred {c['label']}: {col} {kp:.5f} "
                       f"against {kc:.5f}, and the centred costs {size}")
    return out


