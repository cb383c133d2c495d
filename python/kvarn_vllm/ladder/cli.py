"""The command line of kvarn-vllm-ladder (package docstring): the options
checked, the text cut into windows, one engine per format run
(engine.run_job), the rows scored against the reference and reported
(table or JSON, and the plot)."""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from .common import PROG, UsageError
from .engine import run_job
from .formats import (ModelFacts, _vllm_cache_dtypes, coverage_warnings, expand_formats,
                      model_uses_mla)
from .plot import plot
from .progress import Progress
from .report import sliding_window_notes, table, value_bias_notes
from .score import EXACT_VOCAB, FOLD_TOP, FORMAT_TOP, ref_ppl, score


def parse_size(text: str) -> int:
    """Bytes from "16GiB", "512MiB", "1GB", "65536" (K/M/G/T with i: powers
    of 1024, without: of 1000). Raises UsageError on anything else or a
    size <= 0."""
    s = text.strip()
    units = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    i = len(s)
    while i > 0 and s[i - 1].isalpha():
        i -= 1
    num, unit = s[:i], s[i:].lower()
    try:
        val = float(num) * units[unit]
    except (ValueError, KeyError):
        raise UsageError(f"--budget/--engine-kv: {text!r} is not a size (e.g. 16GiB, 512MiB, "
                         f"1e9)") from None
    if val < 1:
        raise UsageError(f"--budget/--engine-kv: {text!r} must be positive")
    return int(val)



def _windows(args, tokenizer_dir: str, warnings: list) -> tuple:
    """(windows of token ids, tokens read, ctx, n windows): the text
    tokenized once by the model's tokenizer (special tokens as it adds them,
    as kvarn eval adds BOS where the tokenizer does), windows of ctx tokens
    from its start; --ctx and --windows lowered to what the text holds, with
    a warning each (kvarn eval's rule). Only a prefix of a long text is
    tokenized, one that holds windows * ctx + 64 tokens or more (its last
    tokens may differ from the whole text's; the windows do not reach them)."""
    if args.token_ids:
        with open(args.token_ids, encoding="utf-8") as f:
            ids = json.load(f)
        if not isinstance(ids, list) or not all(isinstance(x, int) and x >= 0 for x in ids):
            raise UsageError(f"--token-ids {args.token_ids}: a JSON list of token ids (ints "
                             f">= 0) is expected")
    else:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        with open(args.text, encoding="utf-8", errors="replace") as f:
            text = f.read()
        need = args.ctx * args.windows
        # tokenize a prefix long enough (the last few tokens of a cut
        # prefix may differ from the whole text's; a margin is kept)
        chars, ids = max(4096, need * 8), []
        while True:
            ids = tok(text[:chars])["input_ids"]
            if chars >= len(text) or len(ids) >= need + 64:
                break
            chars *= 2
    n = len(ids)
    if n < 2:
        raise UsageError(f"the text holds {n} token(s); at least 2 are needed")
    ctx = args.ctx
    if ctx > n:
        warnings.append(f"the text holds {n} tokens: --ctx lowered to {n}")
        ctx = n
    nw = args.windows
    if nw > n // ctx:
        warnings.append(f"the text holds {n} tokens: --windows lowered to {n // ctx} "
                        f"(windows of {ctx})")
        nw = n // ctx
    return [ids[w * ctx:(w + 1) * ctx] for w in range(nw)], n, ctx, nw


def _model_config(model: str) -> dict:
    """The model directory's config.json, or UsageError saying what is
    needed."""
    if os.path.isfile(model):
        hint = (" (vLLM's CPU build cannot load this project's GGUF; convert it with "
                "`python -m kvarn_vllm.convert_gguf FILE.gguf OUT_DIR`, as "
                "scripts/setup.sh --vllm does for models/SmolLM2-135M-Instruct-hf)"
                if model.endswith(".gguf") else "")
        raise UsageError(f"--model {model}: a file; a Hugging Face model directory (with "
                         f"config.json) is needed{hint}")
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise UsageError(f"--model {model}: no config.json there; a Hugging Face model "
                         f"directory is needed (e.g. models/SmolLM2-135M-Instruct-hf, made by "
                         f"scripts/setup.sh --vllm)")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG, description="The quality ladder of KV-cache formats through vLLM: capacity "
        "at a KV budget and KLD/top-1/PPL to the unquantized cache, per format (docs/eval.md).")
    ap.add_argument("--model", required=True, help="Hugging Face model directory vLLM serves")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="text file; windows of its tokens are measured")
    src.add_argument("--token-ids", help="JSON list of token ids instead of --text (a model "
                     "whose tokenizer does not fit the text)")
    ap.add_argument("--kv-cache-dtype", default="all",
                    help="all, or a comma list of vLLM's names and kvarn_* names, each "
                    "optionally with :KVARN_X=V settings (default all)")
    ap.add_argument("--ctx", type=int, default=2048, help="tokens per window (default 2048)")
    ap.add_argument("--windows", type=int, default=4, help="windows of the text (default 4)")
    ap.add_argument("--decode", type=int, default=256,
                    help="last positions of each window scored as decoded (default 256)")
    ap.add_argument("--budget", default="16GiB",
                    help="KV budget the capacity columns are computed for (default 16GiB)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the server's max_num_seqs for the capacity columns (default: per "
                    "format, the most --ctx requests that fit)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096,
                    help="the server's and the engines' max_num_batched_tokens (default 4096, "
                    "vLLM 0.32's for LLM(...) on CPU; sizes the plug-in's scratch)")
    ap.add_argument("--dtype", default="float32",
                    help="the model's dtype in vLLM (default float32)")
    ap.add_argument("--engine-kv", default="1GiB",
                    help="KV budget of each measuring engine (default 1GiB)")
    ap.add_argument("--json", help="write the report as JSON to this file ('-': stdout, "
                    "instead of the table)")
    ap.add_argument("--plot", help="write a PNG of decode KLD (log) vs capacity (matplotlib)")
    return ap


def main(argv=None) -> int:
    t_wall = time.perf_counter()
    args = build_parser().parse_args(argv)
    try:
        return _main(args, t_wall)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted (the running engine was stopped)", file=sys.stderr)
        return 130


def _main(args, t_wall: float) -> int:
    for opt, v, lo in (("--ctx", args.ctx, 2), ("--windows", args.windows, 1),
                       ("--decode", args.decode, 0)):
        if v < lo:
            raise UsageError(f"{opt} must be >= {lo} (got {v})")
    if args.max_num_batched_tokens < 1:
        raise UsageError(f"--max-num-batched-tokens must be >= 1 (got "
                         f"{args.max_num_batched_tokens})")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise UsageError(f"--max-num-seqs must be >= 1 (got {args.max_num_seqs})")
    budget, engine_kv = parse_size(args.budget), parse_size(args.engine_kv)
    hf = _model_config(args.model)
    if args.text is not None:
        if not os.path.isfile(args.text):
            raise UsageError(f"--text {args.text}: no such file")
        if os.path.getsize(args.text) == 0:
            raise UsageError(f"--text {args.text}: empty, nothing to measure")
    elif not os.path.isfile(args.token_ids):
        raise UsageError(f"--token-ids {args.token_ids}: no such file")
    for opt, path in (("--json", args.json), ("--plot", args.plot)):
        # checked before the run, which may take hours: not at its end
        d = os.path.dirname(os.path.abspath(path)) if path and path != "-" else None
        if d is not None and not (os.path.isdir(d) and os.access(d, os.W_OK)):
            raise UsageError(f"{opt} {path}: its directory {d} does not exist or is not "
                             f"writable")
    plt = None
    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise UsageError(f"--plot needs matplotlib, which {sys.executable} lacks: "
                             f"`{sys.executable} -m pip install matplotlib` (scripts/setup.sh "
                             f"--vllm installs it)") from None
    vllm_names = _vllm_cache_dtypes()
    mla, latent, rope, conf_dtype = model_uses_mla(args.model)
    dtype = {"auto": conf_dtype, "half": "float16", "float": "float32"}.get(args.dtype,
                                                                            args.dtype)
    facts = ModelFacts(args.model, mla, latent, rope, dtype)
    jobs, refused = expand_formats(args.kv_cache_dtype, vllm_names, facts)
    warnings = []
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # the engines are forked
    windows, n_tokens, ctx, nw = _windows(args, args.model, warnings)
    vocab = hf.get("vocab_size") or hf.get("text_config", {}).get("vocab_size")
    if vocab and max(max(w) for w in windows) >= vocab:
        raise UsageError(f"the text's token ids reach {max(max(w) for w in windows)}, beyond "
                         f"the model's vocabulary of {vocab} (a tokenizer that does not fit "
                         f"the model: give --token-ids)")
    decode = args.decode
    if decode > ctx - 1:
        warnings.append(f"--decode {decode} lowered to {ctx - 1} (--ctx - 1)")
        decode = ctx - 1
    warnings += coverage_warnings(jobs, ctx, decode)
    for wmsg in warnings:     # before the run, as kvarn eval warns
        print(f"{PROG}: warning: {wmsg}", file=sys.stderr)
    exact = bool(vocab) and vocab <= EXACT_VOCAB
    top = vocab if exact else FORMAT_TOP
    n_warned = len(warnings)
    import vllm
    from vllm import LLM, SamplingParams  # noqa: F401  (imported once, inherited by every engine)
    cfg = dict(model=args.model, dtype=args.dtype, ctx=ctx, windows=windows, top=top,
               budget=budget, engine_kv=engine_kv, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, decode=decode, mla=mla,
               attention_backend=facts.backend_asked)
    progress = Progress(len(jobs), nw)
    tmp = tempfile.mkdtemp(prefix="kvarn_ladder_")
    results, keep_logs = [], False
    try:
        for i, job in enumerate(jobs, 1):
            res = run_job(job, cfg, tmp, i, progress)
            if "error" in res:
                keep_logs = True
            results.append(res)
            if i == 1 and "error" in res:
                break
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        progress.end()
    ref = results[0]
    if "error" in ref:
        print(f"{PROG}: error: vLLM cannot serve {args.model} with its own cache (auto): "
              f"{ref['error']} (vLLM's output: {ref['log']})", file=sys.stderr)
        return 1
    report = dict(model=args.model, text=args.text or args.token_ids, text_tokens=n_tokens,
                  ctx=ctx, windows=nw, decode=decode, budget_bytes=budget,
                  engine_kv_bytes=engine_kv, max_num_seqs=args.max_num_seqs,
                  dtype=args.dtype, model_dtype=ref["model_dtype"], vocab=ref["vocab"],
                  head_dim=ref["head_dim"], value_bias=ref["value_bias"],
                  sliding_layers=ref.get("sliding_layers"),
                  vllm_version=vllm.__version__,
                  kld_mode="exact" if exact else f"folded_top{FOLD_TOP}_vs_top{FORMAT_TOP}",
                  mla=mla, decode_mode="forced" if mla and decode > 0 else "prompt_logprobs",
                  warnings=warnings, formats=[])
    if ref.get("use_mla") != mla:
        warnings.append(f"vLLM runs {args.model} {'with' if ref.get('use_mla') else 'without'} "
                        f"MLA, which the ladder read otherwise from its config: its format "
                        f"checks and its decode columns do not fit this model")
    ref_cap = ref["capacity"]
    report["max_num_batched_tokens"] = ref_cap.get("max_num_batched_tokens")
    rppl = ref_ppl(ref)
    status = 0
    for job, res in zip(jobs, results):
        row = dict(label=job.label, name=job.name, env=job.env,
                   status="reference" if res is ref else "ok")
        if "error" in res:
            row.update(status="refused", reason=res["error"].split("\n")[0], log=res["log"])
            if job.explicit:
                status = 1
            report["formats"].append(row)
            continue
        cap = res["capacity"]
        if "error" in cap:
            warnings.append(f"{job.label}: capacity not computed: {cap['error']}")
        elif cap["engine_blocks_predicted"] != res["engine_blocks"]:
            warnings.append(f"{job.label}: the capacity computation gives "
                            f"{cap['engine_blocks_predicted']} blocks for the measuring engine, "
                            f"which vLLM gave {res['engine_blocks']}: its --budget figures are "
                            f"not vLLM's")
        kv = cap.get("kv_tokens")
        rkv = ref_cap.get("kv_tokens")
        row.update(bytes_per_token=cap.get("bytes_per_token"), block_size=cap.get("block_size"),
                   kv_tokens=kv, x_ref=kv / rkv if kv and rkv else None,
                   pool_bytes=cap.get("pool_bytes"), max_num_seqs=cap.get("max_num_seqs"),
                   kv_cache_groups=cap.get("kv_cache_groups"),
                   blocks_per_request=cap.get("blocks_per_request"),
                   requests_fit=cap.get("requests_fit"), capped=cap.get("capped"),
                   capacity_refusal=cap.get("refusal"),
                   attention_backends=res.get("attention_backends"),
                   engine_seconds_start=res["start_s"], seconds=res["run_s"])
        if res is ref:
            row.update(ppl=rppl, positions=sum(len(w["actual_lp"]) for w in ref["windows"]))
        else:
            row.update(score(ref, res, ctx, decode, exact))
            row["ppl_delta"] = row["ppl"] - rppl
        report["formats"].append(row)
    for label, why in refused:
        report["formats"].append(dict(label=label, name=label.split(":")[0], env={},
                                      status="refused", reason=why))
    report["value_bias_notes"] = value_bias_notes(report)
    report["sliding_window_notes"] = sliding_window_notes(report)
    report["wall_s"] = time.perf_counter() - t_wall
    if args.json == "-":
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        print(table(report))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1)
    if plt is not None:
        plot(report, args.plot, plt)
    for wmsg in warnings[n_warned:]:
        print(f"{PROG}: warning: {wmsg}", file=sys.stderr)
    print(f"{PROG}: {len(jobs)} engine(s), wall time {report['wall_s']:.0f} s"
          + (f"; vLLM's output of the failed ones kept in {tmp}" if keep_logs else ""),
          file=sys.stderr)
    if not keep_logs:
        shutil.rmtree(tmp, ignore_errors=True)
    return status
