"""Bytes stored per prompt token and time to first token on a file-tier hit
against recomputing (docs/vllm-connectors.md), one run each, printed.

    PYTHONPATH=python .venv-vllm/bin/python bench/offload_ttft.py [DTYPE] [TOKENS] [--lmcache]

--lmcache: the same through LMCache's multiprocess server
(kvarn_vllm.lmcache_mp; a server started here on loopback, chunk size 256,
tests/vllm/lmcache_server.py; for a KVarN format every run, cold
included, with KVARN_SINK_TILES=0, which that connector needs); the bytes are the
server's L1 memory.

For a TOKENS-token prompt (default 2048 - 8, Persuasion) on SmolLM2-135M
(fp32 model), cache dtype DTYPE (default kvarn_k4v2_g128), each in a fresh
engine process (tests/vllm/run_llm.py, max_tokens 1, so the generate time
is the time to first token; a short unrelated prompt runs first in each): cold (no connector), store (connector on, an
empty root in a temporary directory; its time includes writing the files),
hit (a fresh engine on that root). Prints the bytes of the files per
prompt token (whole blocks only) against bf16's 2 Hk D 2 layers, and the
three times in seconds; the hit's greedy token must equal the cold one.
"""
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct-hf")
LAYERS, HK, D = 30, 3, 64


def run(cfg: dict) -> dict:
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "vllm", "run_llm.py"),
                        json.dumps(cfg)], capture_output=True, text=True, timeout=900)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"run failed (rc {p.returncode}):\n{p.stderr[-4000:]}")


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--lmcache"]
    dtype = args[0] if args else "kvarn_k4v2_g128"
    n = int(args[1]) if len(args) > 1 else 2040
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(MODEL)
    with open(os.path.join(ROOT, "data", "austen", "persuasion.txt"), encoding="utf-8") as f:
        ids = tok(f.read()[2000:40000]).input_ids[:n]
    assert len(ids) == n
    base = dict(model=MODEL, kv_cache_dtype=dtype, prompt_ids=[ids], max_tokens=1,
                logprobs=1, prefix_caching=True, max_num_seqs=2, max_model_len=n + 64,
                kv_cache_memory_bytes=512 << 20, stats=True,
                # a short unrelated prompt first: the engine's first-step costs
                # (staging pool, thread pools) stay out of the timed request
                warm_prompts=["The capital of France is"])
    if "--lmcache" in sys.argv:
        return lmcache(base, dtype, n)
    with tempfile.TemporaryDirectory(prefix="kvarn-kv-") as root:
        ktc = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"spec_name": "KvarnFileSpec",
                                             "spec_module_path": "kvarn_vllm.offload",
                                             "root": root}}
        cold = run(base)
        # a second short request, so that the engine steps once more and the
        # prompt's last store (deferred a step, offloading/worker.py:236) runs
        store = run(dict(base, kv_transfer_config=ktc, rounds=[{"prompt_ids": [ids[:8]]}]))
        files = glob.glob(os.path.join(root, "*", "*.blk"))
        sinks = glob.glob(os.path.join(root, "*", "*.sink"))
        stored = sum(os.path.getsize(f) for f in files)
        sink_bytes = sum(os.path.getsize(f) for f in sinks)
        hit = run(dict(base, kv_transfer_config=ktc))
    toks = len(files) * 128
    _report(f"{dtype}, prompt {n} tokens: {len(files)} blocks stored", toks, stored,
            f"; sink copies {sink_bytes} bytes ({(stored + sink_bytes) / max(toks, 1):.0f} "
            "B/token with them)", cold, store, hit)


def _report(head: str, toks: int, stored: int, tail: str, cold: dict, store: dict,
            hit: dict) -> None:
    """Bytes per stored token against bf16's, then the three times."""
    bf16 = 2 * HK * D * 2 * LAYERS
    c, h = cold["outputs"][0], hit["outputs"][0]
    print(f"{head} ({toks} tokens), {stored} bytes = {stored / max(toks, 1):.0f} B/token "
          f"(bf16 {bf16} B/token, {bf16 * toks / max(stored, 1):.2f}x smaller){tail}")
    print(f"time to first token: cold {cold['gen_seconds']:.3f} s, store run "
          f"{store['gen_seconds']:.3f} s, hit {hit['gen_seconds']:.3f} s "
          f"({h['num_cached_tokens']} tokens loaded); "
          f"first token equal: {c['token_ids'] == h['token_ids']}")


def lmcache(base: dict, dtype: str, n: int) -> None:
    sys.path.insert(0, os.path.join(ROOT, "tests", "vllm"))
    from lmcache_server import ENV, Server
    os.environ.update(ENV)
    from kvarn_vllm import _lib
    if dtype.startswith("kvarn_") and _lib.parse_format(dtype).per_tile:
        base = dict(base, env={"KVARN_SINK_TILES": "0"})   # the connector needs it
    with tempfile.TemporaryDirectory(prefix="kvarn-lmcache-") as tmp:
        server = Server(os.path.join(tmp, "server.log"), 256)
        try:
            cold = run(base)
            store = run(dict(base, kv_transfer_config=server.ktc()))
            time.sleep(2)          # stores are asynchronous
            l1 = server.l1()
            hit = run(dict(base, kv_transfer_config=server.ktc()))
        finally:
            server.stop()
    _report(f"{dtype} through LMCache, prompt {n} tokens: "
            f"{l1['total_object_count']} chunks", l1["total_object_count"] * 256,
            l1["memory_used_bytes"], "", cold, store, hit)


if __name__ == "__main__":
    main()
