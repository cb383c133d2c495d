"""Where a serving step's time goes, by kind of step, through vLLM's CPU
build: vLLM's own cache (its CPU attention backend) against the kvarn
plug-in, the same requests (docs/vllm.md "Where a step's time goes").

    .venv-vllm/bin/python bench/vllm_step_profile.py [--requests 4]
        [--prompt-tokens 4096] [--gen 64] [--speculative K]
        [--dtypes bfloat16,kvarn_k4v2_g128] [--repeat N] [--model-dtype bfloat16]
        [--json FILE]

Each format runs in a fresh process with the engine in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, prefix caching off), greedy, EOS
ignored; prompts are distinct Austen passages cut to --prompt-tokens (each
a passage said --repeat N times, as in vllm_throughput.py). The
model runner's execute_model is wrapped to time every step and sort it by
kind: "prefill" (more tokens than 1 + K per request), "verify" (a
speculative step: more than one token per request), "decode" (one token
per request). Within each step the attention backend's calls are timed:
for vLLM's cache its forward (the attention) and its KV update; for kvarn
the backend forward and, inside it, the C attention call
(kvarn_attn_multi), the store (kvarn_paged_store), the commit and the
step's plan (staging.py). Wall clock (time.perf_counter): run it on an
otherwise idle core (e.g. OMP_NUM_THREADS=1 KVARN_ATTN_THREADS=1 taskset
-c 1), as vLLM serves with one torch thread per worker.
"""
import argparse
import collections
import json
import os
import sys
import time

from vllm_throughput import austen_prompts, run_fresh   # bench/, this script's folder

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct-hf")


def _timed(table, counts, state, cls, name, key):
    """Replace cls.name by a wrapper adding its wall time to table[(kind, key)]."""
    f = getattr(cls, name)

    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            table[(state["kind"], key)] += time.perf_counter() - t
            counts[(state["kind"], key)] += 1
    setattr(cls, name, g)


def one(cfg: dict) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.worker import gpu_model_runner as gmr
    T, N = collections.defaultdict(float), collections.defaultdict(int)
    state = {"kind": None}
    spec = cfg["spec"]
    orig = gmr.GPUModelRunner.execute_model

    def execute_model(self, so, *a, **k):
        nt, ns = so.total_num_scheduled_tokens, max(1, len(so.num_scheduled_tokens))
        state["kind"] = "prefill" if nt > ns * (spec + 1) else ("verify" if nt > ns else "decode")
        t = time.perf_counter()
        try:
            return orig(self, so, *a, **k)
        finally:
            T[(state["kind"], "step")] += time.perf_counter() - t
            N[(state["kind"], "step")] += 1
            T[(state["kind"], "tokens")] += nt
    gmr.GPUModelRunner.execute_model = execute_model
    if cfg["dtype"].startswith("kvarn"):
        from kvarn_vllm import _lib, backend, ops, staging
        for cls, name, key in ((backend.KvarnAttentionImpl, "forward", "attention"),
                               (ops.CpuOps, "attend", "attend"), (ops.CpuOps, "store", "store"),
                               (ops.CpuOps, "commit", "commit"), (staging.Staging, "plan", "plan")):
            _timed(T, N, state, cls, name, key)
        lib = _lib.lib()
        cfn = lib.kvarn_attn_multi

        def c_attn(*a):
            t = time.perf_counter()
            try:
                return cfn(*a)
            finally:
                T[(state["kind"], "C attention")] += time.perf_counter() - t
                N[(state["kind"], "C attention")] += 1
        lib.kvarn_attn_multi = c_attn
    else:
        from vllm.v1.attention.backends import cpu_attn
        impl = cpu_attn.CPUAttentionBackendImpl
        _timed(T, N, state, impl, "forward", "attention")
        if hasattr(impl, "do_kv_cache_update"):
            _timed(T, N, state, impl, "do_kv_cache_update", "store")
    extra = {}
    if spec:
        extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": spec,
                                       "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    P, n = cfg["prompt_tokens"], cfg["requests"]
    llm = LLM(model=MODEL, dtype=cfg.get("model_dtype", "bfloat16"), enforce_eager=True, seed=0, **extra,
              kv_cache_dtype=cfg["dtype"], block_size=128, enable_prefix_caching=False,
              kv_cache_memory_bytes=cfg["kv_bytes"], max_num_seqs=n,
              max_model_len=P + cfg["gen"] + 128)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in austen_prompts(n, P, cfg.get("repeat", 1))]
    T.clear()
    N.clear()
    sp = SamplingParams(temperature=0, max_tokens=cfg["gen"], ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    res = {"dtype": cfg["dtype"], "spec": spec, "seconds": time.perf_counter() - t0,
           "out_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
           "layers": llm.llm_engine.vllm_config.model_config.get_num_layers(
               llm.llm_engine.vllm_config.parallel_config), "kinds": {}}
    for (kind, key), v in T.items():
        d = res["kinds"].setdefault(kind, {})
        d[key] = v
        d[key + " calls"] = N[(kind, key)]
    return res


def report(rows: list) -> None:
    keys = ("attention", "C attention", "store", "plan", "commit")
    print(f"{'cache':28} {'spec':>4} {'kind':8} {'steps':>5} {'ms/step':>8} "
          f"{'tok/step':>8} " + " ".join(f"{k + ' ms/layer':>18}" for k in keys[:3])
          + f" {'plan ms/step':>12} {'commits':>7}")
    for r in rows:
        for kind in ("prefill", "decode", "verify"):
            d = r["kinds"].get(kind)
            if not d:
                continue
            ns = d["step calls"]
            per_layer = []
            for k in keys[:3]:
                c = d.get(k + " calls", 0)
                per_layer.append(f"{1e3 * d[k] / c:18.3f}" if c else f"{'-':>18}")
            plan = f"{1e3 * d['plan'] / ns:12.2f}" if "plan" in d else f"{'-':>12}"
            print(f"{r['dtype']:28} {r['spec']:>4} {kind:8} {ns:>5} {1e3 * d['step'] / ns:8.1f} "
                  f"{d['tokens'] / ns:8.1f} " + " ".join(per_layer)
                  + f" {plan} {d.get('commit calls', 0):>7}")
        print(f"{'':28} {'':>4} total {r['seconds']:.1f} s, {r['out_tokens']} tokens out")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--kv-bytes", type=int, default=512 << 20)
    ap.add_argument("--dtypes", default="bfloat16,kvarn_k4v2_g128")
    ap.add_argument("--speculative", type=int, default=0, metavar="K",
                    help="also run each format with n-gram speculation of K tokens")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="each prompt one passage said N times (speculation at equal acceptance)")
    ap.add_argument("--model-dtype", default="bfloat16",
                    help="the model's weights and activations (float32: the weights' products "
                         "without bf16 conversions on CPUs that lack bf16 instructions)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(json.loads(a.one))), flush=True)
        return
    rows = []
    for d in a.dtypes.split(","):
        for k in ((0, a.speculative) if a.speculative else (0,)):
            cfg = dict(dtype=d, spec=k, requests=a.requests, prompt_tokens=a.prompt_tokens,
                       gen=a.gen, kv_bytes=a.kv_bytes, repeat=a.repeat, model_dtype=a.model_dtype)
            r = run_fresh(__file__, cfg, d)
            if r is not None:
                rows.append(r)
    print(f"{a.requests} requests x {a.prompt_tokens} prompt + {a.gen} generated tokens, "
          f"model {a.model_dtype}, prefix caching off, torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}, "
          f"kvarn attention threads {os.environ.get('KVARN_ATTN_THREADS', 'default')}")
    report(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
