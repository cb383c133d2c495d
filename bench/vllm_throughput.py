"""Offline serving throughput on vLLM's CPU build at one fixed KV budget:
vLLM's bf16 cache vs the kvarn plug-in (and vLLM's own fp8 cache), the same
requests, in one run (docs/vllm.md "Benchmark"; README "Serve with vLLM").

    .venv-vllm/bin/python bench/vllm_throughput.py [--requests 32]
        [--prompt-tokens 2048] [--gen 128] [--kv-bytes 536870912]
        [--max-num-seqs 32] [--dtypes bfloat16,kvarn_k4v2_g128,fp8_e5m2]
        [--speculative K] [--no-prefix-caching] [--repeat N]

A --dtypes entry may carry environment settings for its run after colons,
e.g. kvarn_k4v2_g128:KVARN_STAGING=fp16 or
kvarn_k4v2_g128:KVARN_SINK_TOKENS=16 (the plug-in's settings, docs/vllm.md).

Prompts are distinct Austen passages (data/austen/all.txt) cut to
--prompt-tokens tokens; --repeat N makes each prompt one passage of
--prompt-tokens / N tokens said N times, which the model goes on copying:
every cache then generates much the same text and the n-gram proposer
finds the same drafts, so speculation runs at about equal acceptance
(docs/vllm.md "Benchmark"). Each cache format runs in a fresh process with the
engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the scheduler
can be watched: peak running requests and preemptions are counted by
wrapping Scheduler.schedule and Scheduler._preempt_request. Prints per
format: KV tokens vLLM reports, requests/s, output tokens/s, peak running,
preemptions, and the ratios to the first format. --speculative K runs each
format twice, without and with vLLM's n-gram speculation (K draft tokens a
step, prompt_lookup 2-4), and adds the mean accepted length (tokens a
verification step produces per request: 1 + accepted drafts / steps with
drafts, from vLLM's spec_decode counters) and the speed-up of speculation.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct-hf")


def one(cfg: dict) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.update(cfg.get("env", {}))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.sched.scheduler import Scheduler
    stats = {"peak_running": 0, "preemptions": 0}
    orig_schedule, orig_preempt = Scheduler.schedule, Scheduler._preempt_request

    def schedule(self, *a, **k):
        out = orig_schedule(self, *a, **k)
        stats["peak_running"] = max(stats["peak_running"], len(self.running))
        return out

    def preempt(self, *a, **k):
        stats["preemptions"] += 1
        return orig_preempt(self, *a, **k)
    Scheduler.schedule, Scheduler._preempt_request = schedule, preempt

    extra = {}
    if cfg.get("spec"):
        extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": cfg["spec"],
                                       "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        extra["disable_log_stats"] = False
    if cfg.get("no_prefix_caching"):
        extra["enable_prefix_caching"] = False
    llm = LLM(model=MODEL, dtype=cfg["model_dtype"], enforce_eager=True, seed=0, **extra,
              kv_cache_dtype=cfg["dtype"].split(":")[0], block_size=128,
              kv_cache_memory_bytes=cfg["kv_bytes"], max_num_seqs=cfg["max_num_seqs"],
              max_model_len=cfg["prompt_tokens"] + cfg["gen"] + 128)
    prompts = [TokensPrompt(prompt_token_ids=p)
               for p in austen_prompts(cfg["requests"], cfg["prompt_tokens"], cfg.get("repeat", 1))]
    sp = SamplingParams(temperature=0, max_tokens=cfg["gen"], ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    cc = llm.llm_engine.vllm_config.cache_config
    if cfg.get("spec"):
        m = {x.name: x.value for x in llm.get_metrics()
             if x.name.startswith("vllm:spec_decode") and hasattr(x, "value")}
        steps = m.get("vllm:spec_decode_num_drafts", 0)
        stats["accept_len"] = 1 + m.get("vllm:spec_decode_num_accepted_tokens", 0) / max(1, steps)
    return dict(dtype=cfg["dtype"], spec=cfg.get("spec", 0),
                kv_tokens=cc.num_gpu_blocks * cc.block_size, seconds=dt,
                req_s=len(outs) / dt, out_tok_s=n_out / dt, **stats)


def austen_prompts(requests: int, tokens: int, repeat: int = 1) -> list:
    """requests token-id lists of `tokens` tokens each: distinct Austen
    passages, each of tokens // repeat tokens said `repeat` times (cut to
    `tokens`). Shared with vllm_step_profile.py."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(MODEL)
    text = open(os.path.join(ROOT, "data", "austen", "all.txt"), encoding="utf-8").read()
    ids = tok(text[: requests * tokens * 6])["input_ids"]
    n = tokens // repeat
    return [(ids[i * n:(i + 1) * n] * (repeat + 1))[:tokens] for i in range(requests)]


def run_fresh(script: str, cfg: dict, label: str):
    """script --one CFG in a fresh process (one engine, one format): the
    dict its "RESULT {json}" line holds, or None after printing why the run
    failed. Shared with vllm_step_profile.py."""
    p = subprocess.run([sys.executable, script, "--one", json.dumps(cfg)],
                       capture_output=True, text=True)
    res = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if p.returncode != 0 or not res:
        print(f"{label}: failed (rc {p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
        return None
    return json.loads(res[0][7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--kv-bytes", type=int, default=512 << 20)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--model-dtype", default="bfloat16")
    ap.add_argument("--dtypes", default="bfloat16,kvarn_k4v2_g128,fp8_e5m2")
    ap.add_argument("--speculative", type=int, default=0, metavar="K",
                    help="also run each format with n-gram speculation of K tokens")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="turn vLLM's prefix caching off (each prompt prefilled in full)")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="each prompt one passage said N times (speculation at equal acceptance)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(json.loads(a.one))), flush=True)
        return
    rows = []
    runs = [(d, k) for d in a.dtypes.split(",")
            for k in ((0, a.speculative) if a.speculative else (0,))]
    for d, k in runs:
        env = dict(kv.split("=", 1) for kv in d.split(":")[1:])
        cfg = dict(dtype=d, env=env, requests=a.requests, prompt_tokens=a.prompt_tokens, gen=a.gen,
                   kv_bytes=a.kv_bytes, max_num_seqs=a.max_num_seqs, model_dtype=a.model_dtype,
                   spec=k, no_prefix_caching=a.no_prefix_caching, repeat=a.repeat)
        r = run_fresh(__file__, cfg, d)
        if r is not None:
            rows.append(r)
    print(f"{a.requests} requests x {a.prompt_tokens} prompt + {a.gen} generated tokens, "
          f"KV budget {a.kv_bytes / 2**20:.0f} MiB, max_num_seqs {a.max_num_seqs}, "
          f"model {a.model_dtype}, {os.cpu_count()} CPUs, torch threads "
          f"{os.environ.get('OMP_NUM_THREADS', 'default')}, prefix caching "
          f"{'off' if a.no_prefix_caching else 'on'}"
          + (f", each prompt a passage said {a.repeat} times" if a.repeat > 1 else ""))
    spec = " ".join(f"{h:>8}" for h in ("spec K", "accept", "x nospec")) if a.speculative else ""
    print(f"{'cache':40} {'KV tokens':>10} {'req/s':>8} {'out tok/s':>10} {'peak run':>9} "
          f"{'preempt':>8} {'x req/s':>8} {'x run':>6} {spec}")
    base = {r["dtype"]: r for r in rows if r["spec"] == 0}
    for r in rows:
        b = rows[0]
        line = (f"{r['dtype']:40} {r['kv_tokens']:>10} {r['req_s']:>8.3f} {r['out_tok_s']:>10.1f} "
                f"{r['peak_running']:>9} {r['preemptions']:>8} {r['req_s'] / b['req_s']:>8.2f} "
                f"{r['peak_running'] / max(1, b['peak_running']):>6.2f}")
        if a.speculative:
            nos = base.get(r["dtype"])
            acc = f"{r['accept_len']:.2f}" if r["spec"] else "-"
            x = f"{r['out_tok_s'] / nos['out_tok_s']:.2f}" if r["spec"] and nos else "-"
            line += f" {r['spec']:>8} {acc:>8} {x:>8}"
        print(line)


if __name__ == "__main__":
    main()
