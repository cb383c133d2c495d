"""Fixtures of the vLLM plug-in tests. They run under the vLLM venv's
python (scripts/setup.sh --vllm makes .venv-vllm; scripts/test.sh runs
them): vLLM, the plug-in and the converted model must be there, and a
missing piece fails the tests (it is not a skip)."""
import json
import math
import os
import subprocess
import sys

import pytest

import forkserver

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HF_MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct-hf")
GGUF_MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
KVARN_CLI = os.path.join(ROOT, "build", "kvarn")
RUN_LLM = os.path.join(os.path.dirname(__file__), "run_llm.py")


_LAUNCHER = None


def pytest_configure(config):
    """Under pytest-xdist (scripts/test.sh: `-n N --dist loadfile`, one
    worker per core), each worker process keeps to CPUs of its own
    (tests/common/xdist_pin.py), and vLLM's OpenMP threads are bound to
    them (VLLM_CPU_OMP_THREADS_BIND; vLLM's "auto" binds every engine to
    the same cores, and two engines' OpenMP threads spinning on shared
    cores slow both). Everything a worker starts (launcher, engines, ranks,
    the kvarn command) inherits them. A worker runs its test files one
    after another as a serial session would: module fixtures, the launcher
    and the engines of a file stay in one process."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "common"))
    from xdist_pin import pin_worker
    mine = pin_worker()
    if mine:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, mine))


def run_llm(cfg: dict, expect_ok: bool = True, timeout: int = 900):
    """One engine in a fresh process (forked by the session's launcher, or
    started alone as `python run_llm.py CFG` with
    KVARN_TEST_FRESH_PROCESS=1); returns (result dict or None, its output:
    stderr then stdout, where vLLM's workers log their errors)."""
    global _LAUNCHER
    cfg = dict(cfg)
    cfg.setdefault("model", HF_MODEL)
    if os.environ.get("KVARN_TEST_FRESH_PROCESS") == "1":
        p = subprocess.run([sys.executable, RUN_LLM, json.dumps(cfg)], capture_output=True,
                           text=True, timeout=timeout, cwd=ROOT)
        rc, out, err = p.returncode, p.stdout, p.stderr
    else:
        if _LAUNCHER is None:
            # run_llm.py --serve: one process per test session that has
            # imported torch and vLLM and forks a fresh child per engine
            # (run_llm.py's docstring, forkserver.py)
            _LAUNCHER = forkserver.Client(RUN_LLM, ["--serve"])
        # the caller's environment now (a test's monkeypatch.setenv reaches
        # the engine, as it does a one-shot process)
        rc, out, err = _LAUNCHER.run({"cfg": cfg, "env": dict(os.environ)}, timeout)
    res = None
    for line in out.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
    if expect_ok and (rc != 0 or res is None):
        raise AssertionError(f"vLLM run failed (rc {rc}) for {cfg}:\n{err[-6000:]}")
    return res, err + out


def pytest_sessionfinish(session, exitstatus):
    if _LAUNCHER is not None:
        _LAUNCHER.close()


VLLM_CPU_BATCHED = 4096   # vLLM 0.32's max_num_batched_tokens for LLM(...) on CPU, per rank


def staging_pool_bytes(layers: int, hk: int, d: int, seqs: int = 8, sink_tiles: int = 1,
                       sink_partial: int = 0, staging: str = "int8",
                       batched: int = VLLM_CPU_BATCHED, G: int = 128) -> int:
    """The plug-in's staging pool of one rank, by hand (docs/vllm.md
    "Capacity"; the default staging on CPU is int8): seqs x (sink tiles +
    tail) pages of every layer, seqs sink slots of r = sink_partial tokens,
    and ceil(batched / G) + 1 scratch tiles of ONE layer (shared), at the
    bytes of one staged token-head (include/kvarn/record.h): int8 2D + 8 (D
    codes + fp16 scale and zero-point, for K and V), fp8_e4m3 2D + 4 (D
    codes + fp16 scale, for K and V), int4 D + 8 (D/2 bytes of codes + fp16
    scale and zero-point, for K and V), fp16 4D (fp16 K and V)."""
    tok = {"int8": 2 * d + 8, "fp8_e4m3": 2 * d + 4, "int4": d + 8, "fp16": 4 * d}[staging]
    page = layers * hk * G * tok
    scratch = (-(-batched // G) + 1) * hk * G * tok
    return seqs * (sink_tiles + 1) * page + seqs * layers * hk * sink_partial * tok + scratch


# Dynamo with the eager backend: vLLM's CPU worker then runs its warm-up
# (which PP needs, test_parallel.py's docstring) without an Inductor compile
PP_COMPILE = dict(enforce_eager=False, compilation_config={"mode": 2, "backend": "eager"})


def bind_threads(world: int) -> dict:
    """VLLM_CPU_OMP_THREADS_BIND: one CPU per rank, round robin over the
    CPUs this process may use (ranks share CPUs where there are fewer)."""
    cpus = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(cpus[i % len(cpus)])
                                                  for i in range(world))}


@pytest.fixture(scope="session")
def hf_model():
    assert os.path.exists(os.path.join(HF_MODEL, "config.json")), \
        f"{HF_MODEL} missing: run scripts/setup.sh --vllm"
    return HF_MODEL


def folded_kld(P, Q, start: int) -> list:
    """KLD of Q to P at every position from start on, over P's top 20 tokens
    with the rest of the mass folded into one bucket (a lower bound);
    P, Q: prompt_logprobs lists ([{token_id: logprob}] per position, entry j
    the distribution at position j - 1). Positions where Q lacks one of P's
    top 20 are skipped."""
    kls = []
    for p, q in zip(P[start:], Q[start:]):
        top = sorted(p.items(), key=lambda kv_: -kv_[1])[:20]
        if any(t not in q for t, _ in top):
            continue
        pm = [math.exp(v) for _, v in top]
        qm = [math.exp(q[t]) for t, _ in top]
        pr, qr = max(1e-12, 1 - sum(pm)), max(1e-12, 1 - sum(qm))
        kl = sum(a * math.log(a / b) for a, b in zip(pm, qm)) + pr * math.log(pr / qr)
        kls.append(max(0.0, kl))
    return kls


def check_greedy_near_tie(ref: dict, run: dict, k_e_max: float) -> None:
    """Greedy tokens of run against those of ref (run_llm results, one
    prompt each, logprobs on): equal, or where they first part the
    reference's margin between its token and run's, in probability, is at
    most sqrt(2 k), k = 2 k_e_max (Pinsker's bound on the total variation of
    two distributions whose KL is at most k; k_e_max: the emulated codec's
    largest per-position KL, doubled for the two hosts' rule of
    test_families)."""
    r, k = ref["outputs"][0], run["outputs"][0]
    i = next((j for j, (a, b) in enumerate(zip(r["token_ids"], k["token_ids"])) if a != b),
             None)
    if i is None:
        print(f"greedy tokens equal ({len(r['token_ids'])})")
        return
    lp = r["logprobs"][i]
    margin = math.exp(lp[r["token_ids"][i]]) - math.exp(lp[k["token_ids"][i]])
    bound = math.sqrt(2 * 2 * k_e_max)
    print(f"greedy tokens first differ at {i}: reference margin {margin:.4f} <= {bound:.4f}")
    assert margin <= bound
