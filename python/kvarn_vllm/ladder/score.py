"""A format's windows scored against the reference's: KLD (exact, or
folded where vLLM returns top-k log-probabilities only), top-1 agreement
and PPL, per prompt and decode column."""
import math

EXACT_VOCAB = 4096     # vocabularies up to this: every entry asked for, exact KLD
FOLD_TOP = 20          # otherwise: the reference's top 20 folded ...
FORMAT_TOP = 100       # ... against the format's top 100


def _stats(kl: list) -> dict:
    """mean, median, p99 (nearest rank), max of per-position KLDs, as
    tools/eval_stats.c computes them; None where there is none."""
    if not kl:
        return dict(mean=None, median=None, p99=None, max=None)
    s = sorted(kl)
    n = len(s)
    med = s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
    r = math.ceil(0.99 * n)
    return dict(mean=sum(s) / n, median=med, p99=s[(r or 1) - 1], max=s[-1])


def score(ref: dict, fmt: dict, ctx: int, decode: int, exact: bool) -> dict:
    """A format's windows against the reference's: per position j (the
    distribution after token j, predicting j + 1; j < ctx - decode: prompt
    columns, else decode columns) KL(reference || format) in nats, exact
    over the whole vocabulary or folded (module docstring), top-1
    agreement, NLL.

    ref, fmt: {"windows": [...]}, one dict per window, as the engine's
    process returns them, with n = ctx - 1 positions: top_ids int32 [n, K]
    and top_lps float32 [n, K] (the K most likely tokens by rank and their
    log-probabilities; K = the vocabulary in exact mode, and every row
    then a permutation of it), actual_lp float32 [n] (the next token's
    log-probability). Folded mode needs K >= FOLD_TOP. Returns kld_mean,
    kld_median, kld_p99, kld_max, top1 (a fraction), prompt_positions,
    kld_partial, the same with decode_ for the decode columns (None where
    a column has no position), ppl over all positions and positions."""
    import numpy as np
    cols = {"prompt": dict(kl=[], top1=0, n=0, partial=0),
            "decode": dict(kl=[], top1=0, n=0, partial=0)}
    nll, npos = 0.0, 0
    for rw, fw in zip(ref["windows"], fmt["windows"]):
        n = len(rw["actual_lp"])
        nll -= float(np.sum(fw["actual_lp"], dtype=np.float64))
        npos += n
        agree = rw["top_ids"][:, 0] == fw["top_ids"][:, 0]
        if exact:
            V = rw["top_ids"].shape[1]
            P = np.empty((n, V))
            Q = np.empty((n, V))
            rows = np.arange(n)[:, None]
            P[rows, rw["top_ids"]] = rw["top_lps"]
            Q[rows, fw["top_ids"]] = fw["top_lps"]
            kl = np.maximum(0.0, np.sum(np.exp(P) * (P - Q), axis=1)).tolist()
            ok = [True] * n
        else:
            kl, ok = [], []
            for j in range(n):
                # the reference's top FOLD_TOP tokens that the format's top
                # FORMAT_TOP holds (both masses known), the rest one bucket:
                # a partition of the vocabulary, so a lower bound of the
                # exact KL whatever the format's top lacks (ok: lacks none)
                q = dict(zip(fw["top_ids"][j].tolist(), fw["top_lps"][j].tolist()))
                top = rw["top_ids"][j, :FOLD_TOP].tolist()
                lps = rw["top_lps"][j, :FOLD_TOP].tolist()
                both = [(lp_, q[t]) for t, lp_ in zip(top, lps) if t in q]
                pm = np.exp(np.array([a for a, _ in both], dtype=np.float64))
                qm = np.exp(np.array([b for _, b in both], dtype=np.float64))
                pr, qr = max(1e-12, 1 - pm.sum()), max(1e-12, 1 - qm.sum())
                k = float(np.sum(pm * np.log(pm / qm)) + pr * math.log(pr / qr))
                kl.append(max(0.0, k))
                ok.append(len(both) == len(top))
        for j in range(n):
            c = cols["prompt" if j < ctx - decode else "decode"]
            c["n"] += 1
            c["top1"] += int(agree[j])
            c["kl"].append(kl[j])
            c["partial"] += int(not ok[j])
    out = dict(ppl=math.exp(nll / npos) if npos else None, positions=npos)
    for name, c in cols.items():
        pre = "" if name == "prompt" else "decode_"
        st = _stats(c["kl"])
        out.update({pre + "kld_mean": st["mean"], pre + "kld_median": st["median"],
                    pre + "kld_p99": st["p99"], pre + "kld_max": st["max"],
                    pre + "top1": c["top1"] / c["n"] if c["n"] else None,
                    name + "_positions": c["n"], pre + "kld_partial": c["partial"]})
    return out


def ref_ppl(ref: dict) -> float:
    import numpy as np
    nll = -sum(float(np.sum(w["actual_lp"], dtype=np.float64)) for w in ref["windows"])
    n = sum(len(w["actual_lp"]) for w in ref["windows"])
    return math.exp(nll / n)


