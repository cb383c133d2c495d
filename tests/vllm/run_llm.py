"""Run one vLLM configuration in a fresh process and print its results as
one JSON line (the tests compare runs; a process per run keeps each engine's
state and the plug-in's per-process staging pool apart).

    python run_llm.py '{"kv_cache_dtype": "kvarn_k4v2_g128", "prompts": [...], ...}'
    python run_llm.py --serve

--serve (conftest.run_llm starts one per test session; the protocol is
forkserver.py's): import torch and vLLM once, then for each request line
on stdin ({"cfg": {...}, "out": PREFIX, "timeout": S}) fork a child
(kvarn_vllm._proc.run, the package's one launcher) that runs the
configuration exactly as the one-shot form does, its stdout and stderr in
PREFIX.out / PREFIX.err, and answer one line {"rc": N, "timed_out": bool}
(timed out: killed with its process group after S seconds). The child's
environment is the request's "env" (the caller's os.environ at the call)
where given. When the launcher stops (stdin closed, SIGINT / SIGTERM, its
parent gone) the running child's process group is killed first, so an
interrupted test session leaves no engine or rank behind. Each engine
still gets a process of its own, forked from a parent that has run
nothing but the imports (no engine, no plug-in, no torch thread pool); the
~5-10 s of importing torch and vLLM is paid once per session instead of
once per engine.

Keys: model, kv_cache_dtype, block_size (128), kv_space_gib (1),
speculative_config (null: none; vLLM's dict, e.g. {"method": "ngram", ...}),
ignore_eos (false), stats (false: true adds vLLM's speculative-decoding
counters and the generation time),
max_num_seqs (8), max_num_batched_tokens (null: vLLM's), prefix_caching
(false), warm_prompts (run first, e.g. to fill the prefix cache),
kv_transfer_config (null; vLLM's dict, e.g. the OffloadingConnector's
with kvarn_vllm.offload's KvarnFileSpec), kv_cache_memory_bytes (null; when set, the KV budget per worker in bytes
instead of kv_space_gib), load_format, prompts (text) or prompt_ids
(token-id lists), max_tokens (16), logprobs (null), prompt_logprobs (null),
max_logprobs (20), dtype (the model's, "float32"), tensor_parallel_size (1),
pipeline_parallel_size (1), distributed_executor_backend (null: vLLM's),
enforce_eager (true), compilation_config (null: vLLM's), native_rope (false:
true runs vLLM's RotaryEmbedding.forward_native where it would run
forward_cpu, whose CPU kernel mis-rotates DeepSeek MLA's strided q/k views,
tests/vllm/emulate_mla.py; in-process engines only), attention_backend (null:
vLLM's choice; e.g. "CPU_MLA", vLLM's reference MLA backend, which it picks
on every CPU kind when asked), fake_amx (false: true makes
torch.cpu._is_amx_tile_supported() answer True before LLM(...), so that a
host without AMX tiles takes vLLM's start-up decisions for one that has
them; only for configurations that then run no AMX instruction, such as
an fp32 model with CPU_MLA forced; in-process engines only), env (variables set
before LLM(...) is built: before vLLM is imported in the one-shot form, but
after it under --serve, where a variable read at import (the OpenMP
runtime's OMP_*, vLLM's platform detection) keeps the launcher's value;
VLLM_ENABLE_V1_MULTIPROCESSING is 0 unless set there), dense_logprobs (N: each position's logprobs as a list of the
first N token ids' in id order, for logprobs covering the whole
vocabulary; such a run does not detokenize, its "text" is empty, and
takes vLLM's flat logprobs: the token strings of 2048 logprobs a position
cost an engine ~10 s), rounds (after prompts, more generate calls in the same engine,
each a dict of prompt_ids, logprobs, prompt_logprobs; their outputs in
"rounds").
Prints {"kv_tokens": N, "outputs": [{"text", "token_ids", "logprobs",
"prompt_logprobs"}...]}; logprobs as [{token_id: logprob}] per position.
If LLM(...) raises, prints STARTUP_ERROR "<type>: <message>" (JSON) first.
"""
import json
import os
import sys


def main() -> None:
    cfg = json.loads(sys.argv[1])
    if cfg.get("kv_cache_memory_bytes") is None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.get("kv_space_gib", 1))
    else:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the bytes
    # The engine core in this process (vLLM's in-process client) rather than
    # in a process of its own with the model in a third: each of those
    # imports torch and vLLM again, ~35 s of a ~55 s run on 2 cores, and the
    # plug-in's code is the same. Runs over several ranks (TP/PP) still put
    # their workers in processes of their own; `vllm serve`
    # (test_openai_server) and {"env": {"VLLM_ENABLE_V1_MULTIPROCESSING":
    # "1"}} keep vLLM's default layout.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.update(cfg.get("env", {}))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    kw = dict(model=cfg["model"], dtype=cfg.get("dtype", "float32"), seed=0,
              enforce_eager=cfg.get("enforce_eager", True),
              kv_cache_dtype=cfg.get("kv_cache_dtype", "auto"),
              block_size=cfg.get("block_size", 128),
              max_num_seqs=cfg.get("max_num_seqs", 8),
              max_model_len=cfg.get("max_model_len", 2048),
              enable_prefix_caching=cfg.get("prefix_caching", False),
              max_logprobs=cfg.get("max_logprobs", 20))
    for k in ("kv_cache_memory_bytes", "tensor_parallel_size", "pipeline_parallel_size",
              "distributed_executor_backend", "compilation_config", "attention_backend",
              "kv_transfer_config"):
        if cfg.get(k) is not None:
            kw[k] = cfg[k]
    if cfg.get("load_format"):
        kw["load_format"] = cfg["load_format"]
    if cfg.get("speculative_config"):
        kw["speculative_config"] = cfg["speculative_config"]
    if cfg.get("stats"):
        kw["disable_log_stats"] = False
    if cfg.get("max_num_batched_tokens"):
        kw["max_num_batched_tokens"] = cfg["max_num_batched_tokens"]
        kw["enable_chunked_prefill"] = True
    if cfg.get("fake_amx"):
        import torch
        torch.cpu._is_amx_tile_supported = lambda: True
    if cfg.get("native_rope"):
        from vllm.model_executor.layers.rotary_embedding import base as rope_base
        rope_base.RotaryEmbedding.forward_cpu = rope_base.RotaryEmbedding.forward_native
    try:
        llm = LLM(**kw)
    except Exception as e:  # what LLM(...) itself raises, for the tests to read
        print("STARTUP_ERROR " + json.dumps(f"{type(e).__name__}: {e}"), flush=True)
        raise
    if os.environ.get("KVARN_TEST_COMMIT_LOG"):
        # the engine is up: the plug-in's commit log starts (backend.py)
        open(os.environ["KVARN_TEST_COMMIT_LOG"] + ".go", "w").close()
    dense = cfg.get("dense_logprobs", False)
    # dense: ids and values only (FlatLogprobs, no token strings)
    fast = dict(detokenize=False, flat_logprobs=True) if dense else {}
    sp = SamplingParams(temperature=0, max_tokens=cfg.get("max_tokens", 16),
                        logprobs=cfg.get("logprobs"), prompt_logprobs=cfg.get("prompt_logprobs"),
                        ignore_eos=cfg.get("ignore_eos", False), **fast)
    if "prompt_ids" in cfg:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in cfg["prompt_ids"]]
    else:
        prompts = cfg["prompts"]
    for w in cfg.get("warm_prompts", []):
        llm.generate([w], sp, use_tqdm=False)

    def lp(seq):
        if seq is None:
            return None
        if dense:  # every token's logprob, in token-id order
            import numpy as np
            ids, vals = np.asarray(seq.token_ids), np.asarray(seq.logprobs)
            rows = []
            for a, b in zip(seq.start_indices, seq.end_indices):
                # a position holds the chosen token and the top ones, the
                # chosen one possibly twice (same value): unique ids, sorted
                _, first = np.unique(ids[a:b], return_index=True)
                rows.append(vals[a:b][first][:dense].tolist() if b > a else None)
            return rows
        return [None if d is None else {str(t): v.logprob for t, v in d.items()} for d in seq]

    def run(prompts, sp):
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return [{"text": o.outputs[0].text,
                 "token_ids": list(o.outputs[0].token_ids),
                 "prompt_token_ids": list(o.prompt_token_ids),
                 "logprobs": lp(o.outputs[0].logprobs),
                 "prompt_logprobs": lp(o.prompt_logprobs),
                 "num_cached_tokens": o.num_cached_tokens} for o in outs]

    import time
    t0 = time.perf_counter()
    res = {"outputs": run(prompts, sp)}
    gen_s = time.perf_counter() - t0
    rounds = []
    for r in cfg.get("rounds", []):
        rsp = SamplingParams(temperature=0, max_tokens=cfg.get("max_tokens", 16),
                             logprobs=r.get("logprobs"), prompt_logprobs=r.get("prompt_logprobs"),
                             **fast)
        rounds.append(run([TokensPrompt(prompt_token_ids=ids) for ids in r["prompt_ids"]], rsp))
    res["rounds"] = rounds
    cc = llm.llm_engine.vllm_config.cache_config
    res["kv_blocks"] = cc.num_gpu_blocks
    res["kv_tokens"] = None if cc.num_gpu_blocks is None else cc.num_gpu_blocks * cc.block_size
    if cfg.get("stats"):
        res["gen_seconds"] = gen_s
        res["metrics"] = {}
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode") and hasattr(m, "value"):
                res["metrics"][m.name] = m.value
    print("RESULT " + json.dumps(res), flush=True)
    # Stop the engine, then leave without the interpreter's teardown: vLLM's
    # CPU build can abort there ("terminate called without an active
    # exception", seen once in a CI run) after every result was printed.
    # An engine all in this process with no KV connector has nothing to
    # stop that _exit does not end: its shutdown (a gc.collect of the whole
    # heap, ~1 s an engine) is skipped.
    alone = (os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
             and cfg.get("tensor_parallel_size", 1) == 1
             and cfg.get("pipeline_parallel_size", 1) == 1 and not cfg.get("kv_transfer_config"))
    if not alone:
        llm.llm_engine.engine_core.shutdown()
    sys.stderr.flush()
    os._exit(0)


def serve() -> None:
    import signal
    before = dict(os.environ)
    import torch  # noqa: F401  (imported once, inherited by every child)
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401
    from forkserver import serve as serve_requests
    # vLLM resolves its platform at import, the kvarn platform plug-in
    # (kvarn_vllm.platform) among them; the plug-in keeps a cache's state
    # per process (kvarn_vllm.state, the backend), so each child imports it
    assert not {"kvarn_vllm.state", "kvarn_vllm.backend"} & set(sys.modules), \
        "the kvarn backend must be imported by each child (its state is per process)"
    base_env = dict(os.environ)
    # what the imports set (vLLM's TORCHINDUCTOR_*, cv2's LD_LIBRARY_PATH...):
    # a one-shot process sets them too, after its caller's environment
    by_imports = {k: v for k, v in base_env.items() if before.get(k) != v}
    # SIGTERM (a CI runner stopping the job) as SIGINT: unwind, kill the child
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    def child_of(req: dict):
        def engine() -> None:   # in the child: one engine, then _exit
            os.environ.clear()
            os.environ.update(dict(req["env"], **by_imports) if "env" in req else base_env)
            sys.argv = [__file__, json.dumps(req["cfg"])]
            main()  # leaves through os._exit(0)
        return engine
    serve_requests(child_of)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main()
