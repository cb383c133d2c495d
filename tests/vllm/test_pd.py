"""Prefill/decode disaggregation over the file tier (docs/vllm-connectors.md
"Prefill/decode"): two vLLM API servers on loopback, a prefill instance
(kv_role kv_producer) and a decode instance (kv_role kv_consumer), both
kvarn_k4v2_g128 on one KvarnFileSpec root, and kvarn_vllm.pd_proxy in
front of them. The servers and the proxy are started and killed by the
test (their process groups), each step bounded in time.

Through the proxy, SmolLM2 and the prompts of test_offload (P: 300 tokens,
two whole blocks and a partial one; Q: 384, block-aligned): the decode
instance's answer reports 256 cached prompt tokens for each (the prefill
instance's two whole blocks loaded; KVarN recomputes Q's last tile,
scheduler.whole_tile_hits), its log shows the loaded blocks adopted as
records with the sink tile's staged copy, and no block was given up on.
The prefill instance answered with one token, and its last blocks were
stored with no later request to step its engine. The files are the record bytes: printed per prompt
token against bf16's. Then one instance's answer: the same prompts sent
straight to the prefill instance with a cache_salt (other block hashes,
so a cold computation): greedy tokens equal, logprobs within LP_TOL.

The decode instance asked to wait for blocks nobody stores (wait_s 1)
answers after the wait, having computed the prompt itself (cached 0) and
said so in its log; a malformed kvarn_pd is logged and the request
served. Without engines: pd_wait_s, the roles and the waiting of
KvarnFileManager, and the proxy (error of the prefill instance returned
as it came, the decode instance not asked; kv_transfer_params added)."""
import asyncio
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
import urllib.request

import pytest

from conftest import HF_MODEL

sys.path.insert(0, os.path.dirname(__file__))

KV = "kvarn_k4v2_g128"
LAYERS, HK, D = 30, 3, 64          # SmolLM2-135M
BF16_PER_TOKEN = 2 * HK * D * 2 * LAYERS
LP_TOL = 1e-4
START_S = 420                      # both servers up (2 busy cores: ~35-100 s seen)
REQUEST_S = 300
ENGINE = ["--dtype", "float32", "--kv-cache-dtype", KV, "--block-size", "128",
          "--kv-cache-memory-bytes", str(256 << 20), "--max-num-seqs", "2",
          "--max-num-batched-tokens", "2048", "--max-model-len", "2048", "--enforce-eager",
          "--seed", "0", "--enable-prompt-tokens-details"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ktc(role, root):
    # max_bytes: far above what the test stores (the eviction scan runs at
    # every store; test_offload checks what it evicts)
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": role,
                       "kv_connector_extra_config": {"spec_name": "KvarnFileSpec",
                                                     "spec_module_path": "kvarn_vllm.offload",
                                                     "root": root, "max_bytes": "1GiB"}})


def _up(url, proc, log, t0):
    while True:
        assert proc.poll() is None, f"{log} exited:\n" + log.read_text()[-4000:]
        try:
            if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                return
        except OSError:
            pass
        assert time.monotonic() - t0 < START_S, f"{log} not up:\n" + log.read_text()[-3000:]
        time.sleep(2)


@pytest.fixture(scope="module")
def pd(tmp_path_factory, hf_model):
    """(proxy URL, prefill URL, decode URL, {name: log path}, root)."""
    tmp = tmp_path_factory.mktemp("pd")
    root = str(tmp / "kv")
    cpus = sorted(os.sched_getaffinity(0))
    ports = {n: _free_port() for n in ("prefill", "decode", "proxy")}
    urls = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    procs, logs = {}, {}
    for i, (name, role) in enumerate((("prefill", "kv_producer"), ("decode", "kv_consumer"))):
        args = [sys.executable, "-m", "kvarn_vllm.vllm_cli", "serve", HF_MODEL, *ENGINE,
                "--host", "127.0.0.1", "--port", str(ports[name]),
                "--kv-transfer-config", _ktc(role, root)]
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=str(cpus[i % len(cpus)]))
        logs[name] = tmp / f"{name}.log"
        procs[name] = subprocess.Popen(args, stdout=open(logs[name], "w"),
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=env, start_new_session=True)
    logs["proxy"] = tmp / "proxy.log"
    procs["proxy"] = subprocess.Popen(
        [sys.executable, "-m", "kvarn_vllm.pd_proxy", "--prefill", urls["prefill"],
         "--decode", urls["decode"], "--port", str(ports["proxy"]), "--wait-s", "120"],
        stdout=open(logs["proxy"], "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True)
    try:
        t0 = time.monotonic()
        for name in ("prefill", "decode", "proxy"):
            _up(urls[name], procs[name], logs[name], t0)
        print(f"prefill, decode and proxy up in {time.monotonic() - t0:.0f} s")
        yield urls["proxy"], urls["prefill"], urls["decode"], logs, root
    finally:
        for p in procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=60)


def _complete(url, ids, **kw):
    req = dict(model=HF_MODEL, prompt=ids, max_tokens=8, temperature=0, logprobs=1,
               return_token_ids=True, **kw)
    r = urllib.request.urlopen(urllib.request.Request(
        url + "/v1/completions", data=json.dumps(req).encode(),
        headers={"Content-Type": "application/json"}), timeout=REQUEST_S)
    j = json.load(r)
    c = j["choices"][0]
    c["cached"] = (j["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    return c


def test_handover_equals_one_instance(pd):
    from test_offload import _ids
    proxy, prefill, decode, logs, root = pd
    p, q = _ids()
    got = {}
    for name, ids in (("P", p), ("Q", q)):
        t0 = time.monotonic()
        got[name] = _complete(proxy, ids)
        print(f"{name}: {len(ids)} prompt tokens through the proxy in "
              f"{time.monotonic() - t0:.1f} s, decode instance cached {got[name]['cached']}")
        assert got[name]["cached"] == 256, got[name]
    dec = logs["decode"].read_text()
    adopted = [ln for ln in dec.splitlines() if "loaded by a KV connector adopted" in ln]
    assert len(adopted) == 2 and all("2 blocks" in ln and "1 sink" in ln for ln in adopted), \
        adopted
    assert "was not stored within" not in dec
    assert "kv_consumer" in dec and "kv_producer" in logs["prefill"].read_text()
    # what moved: P's 2 and Q's 3 whole blocks, each the records of every
    # layer, and the sink tile's staged copy of each prompt
    from kvarn_vllm import _lib
    fmt = _lib.parse_format(KV, D)
    blk = LAYERS * HK * _lib.record_bytes(fmt, D)
    blocks = glob.glob(os.path.join(root, "*", "*.blk"))
    sinks = glob.glob(os.path.join(root, "*", "*.sink"))
    assert len(blocks) == 5 and {os.path.getsize(f) for f in blocks} == {blk}
    assert len(sinks) == 2 and {os.path.getsize(f) for f in sinks} == \
        {LAYERS * HK * 128 * (2 * D + 8)}
    moved = sum(os.path.getsize(f) for f in blocks + sinks)
    print(f"moved {moved} bytes for 5 whole blocks (640 prompt tokens): {moved / 640:.0f} "
          f"B/token with the sink copies, {blk / 128:.0f} B/token without; bf16 "
          f"{BF16_PER_TOKEN} B/token ({BF16_PER_TOKEN * 640 / moved:.2f}x, "
          f"{BF16_PER_TOKEN * 128 / blk:.2f}x)")
    # one instance: the prefill instance, cold (a cache salt: other hashes)
    for name, ids in (("P", p), ("Q", q)):
        one = _complete(prefill, ids, cache_salt="one-instance")
        assert one["cached"] in (0, None), one
        two = got[name]
        lp1 = one["logprobs"]["token_logprobs"]
        lp2 = two["logprobs"]["token_logprobs"]
        d = max(abs(a - b) for a, b in zip(lp1, lp2))
        print(f"{name}: {one['token_ids']} one instance, {two['token_ids']} handed over; "
              f"largest logprob difference {d:.2e}")
        assert two["token_ids"] == one["token_ids"]
        assert d <= LP_TOL


def test_decode_instance_gives_up_waiting(pd):
    """Blocks nobody stores: the decode instance waits wait_s, then
    computes the prompt itself; a malformed kvarn_pd is logged, not fatal."""
    import numpy as np
    proxy, prefill, decode, logs, root = pd
    ids = [int(x) for x in np.random.default_rng(7).integers(100, 20000, 200)]
    t0 = time.monotonic()
    c = _complete(decode, ids, kv_transfer_params={"kvarn_pd": {"wait_s": 1.0}})
    dt = time.monotonic() - t0
    print(f"gave up after {dt:.1f} s, cached {c['cached']}")
    assert dt >= 1.0 and c["cached"] == 0 and len(c["token_ids"]) == 8
    dec = logs["decode"].read_text()
    assert dec.count("was not stored within") == 1, dec[-3000:]
    c = _complete(decode, ids[:150], kv_transfer_params={"kvarn_pd": {"wait_s": "soon"}})
    assert len(c["token_ids"]) == 8
    assert "must be {\"wait_s\"" in logs["decode"].read_text()


# ---- without engines

def test_pd_wait_s():
    from kvarn_vllm.offload import pd_wait_s
    assert pd_wait_s(None) is None and pd_wait_s({"other": 1}) is None
    assert pd_wait_s({"kvarn_pd": {"wait_s": 2}}) == 2.0
    for bad in ({"wait_s": -1}, {"wait_s": 4000}, {"wait_s": "1"}, {"wait_s": True}, 5,
                {"wait_s": float("nan")}, {}):
        with pytest.raises(ValueError, match="wait_s"):
            pd_wait_s({"kvarn_pd": bad})


def _ctx(rid, params=None):
    return types.SimpleNamespace(req_id=rid, kv_transfer_params=params)


def test_file_manager_roles_and_waiting(tmp_path, monkeypatch):
    from vllm.v1.kv_offload.base import LookupResult
    from kvarn_vllm import offload
    now = [100.0]
    monkeypatch.setattr(offload.time, "monotonic", lambda: now[0])
    key = b"\x01" * 8
    for role in ("kv_both", "kv_consumer", "kv_producer"):
        d = tmp_path / role
        d.mkdir()
        m = offload.KvarnFileManager(str(d), role)
        wait = _ctx("w", {"kvarn_pd": {"wait_s": 5}})
        plain = _ctx("p")
        m.on_new_request(wait)
        m.on_new_request(plain)
        # missing: the waiting request retries (a producer never loads)
        want = LookupResult.MISS if role == "kv_producer" else LookupResult.RETRY
        assert m.lookup(key, wait) == want
        assert m.lookup(key, plain) == LookupResult.MISS
        stored = m.prepare_store([key], plain).keys_to_store
        assert stored == ([] if role == "kv_consumer" else [key])
        open(m.block_path(key), "wb").close()
        assert m.lookup(key, wait) == (LookupResult.MISS if role == "kv_producer"
                                       else LookupResult.HIT)
        os.unlink(m.block_path(key))
        if role != "kv_producer":   # a block found stays found (pinned) for the request
            assert m.lookup(key, wait) == LookupResult.HIT
        other = b"\x02" * 8
        assert m.lookup(other, wait) == want
        now[0] += 5.0           # the wait is over: computed here from now on
        assert m.lookup(other, wait) == LookupResult.MISS
        now[0] -= 5.0
        assert m.lookup(other, wait) == LookupResult.MISS    # not waited for again
        m.on_request_finished(wait)
        m.on_request_finished(plain)
        assert m._deadline == {}
        # a malformed kvarn_pd: the request goes on without waiting
        bad = _ctx("b", {"kvarn_pd": {"wait_s": "x"}})
        m.on_new_request(bad)
        assert m.lookup(key, bad) == LookupResult.MISS
        m.on_request_finished(bad)
        m.shutdown()
    with pytest.raises(ValueError, match="kv_role"):
        offload.KvarnFileManager(str(tmp_path / "x"), "kv_sender")


def test_proxy_bodies_and_errors():
    """The proxy against two fake instances that close idle connections
    after 0.2 s: a request after that is served; a connection the decode
    instance drops unanswered is asked again once, then 502; the prefill body (one token,
    no stream), the decode body (kvarn_pd added, the client's own
    kv_transfer_params kept), a streamed answer relayed as it came, a
    prefill error returned as it came with the
    decode instance not asked, a body that is not JSON refused."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer
    from kvarn_vllm.pd_proxy import make_app

    STREAM = [b'data: {"choices": [{"text": "a"}]}\n\n', b"data: [DONE]\n\n"]
    seen = {"prefill": [], "decode": []}
    fail = [False]
    drop = [0]

    def fake(name):
        async def handle(request):
            body = await request.json()
            seen[name].append(body)
            if name == "decode" and drop[0]:
                drop[0] -= 1            # this connection dropped with no answer
                request.transport.close()
                return web.Response()
            if name == "prefill" and fail[0]:
                return web.json_response({"error": {"message": "too long"}}, status=400)
            if body.get("stream"):
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await out.prepare(request)
                for chunk in STREAM:
                    await out.write(chunk)
                await out.write_eof()
                return out
            return web.json_response({"choices": [{"text": name}]})
        async def health(request):
            return web.Response(text="ok")
        app = web.Application()
        app.router.add_post("/v1/completions", handle)
        app.router.add_get("/health", health)
        return app

    async def run():
        servers = {n: TestServer(fake(n)) for n in seen}
        for s in servers.values():
            # idle connections closed soon, as uvicorn does after 5 s
            await s.start_server(keepalive_timeout=0.2)
        base = {n: str(s.make_url("")).rstrip("/") for n, s in servers.items()}
        client = TestClient(TestServer(make_app([base["prefill"]], [base["decode"]], 7.0)))
        await client.start_server()
        try:
            body = {"prompt": [1, 2, 3], "max_tokens": 50, "stream": False, "min_tokens": 4,
                    "kv_transfer_params": {"mine": 1}}
            # a request after the instances closed the proxy's idle
            # connection (its /health check): answered (the proxy opens a
            # connection per request)
            r = await client.get("/health")
            assert r.status == 200
            await asyncio.sleep(0.6)
            r = await client.post("/v1/completions", json=body)
            assert r.status == 200 and (await r.json())["choices"][0]["text"] == "decode"
            pre, dec = seen["prefill"][-1], seen["decode"][-1]
            assert pre["max_tokens"] == 1 and pre["stream"] is False and "min_tokens" not in pre
            assert dec["max_tokens"] == 50 and dec["min_tokens"] == 4
            assert dec["kv_transfer_params"] == {"mine": 1, "kvarn_pd": {"wait_s": 7.0}}
            # the decode instance drops a connection: asked again; twice: 502
            drop[0] = 1
            r = await client.post("/v1/completions", json=body)
            assert r.status == 200 and (await r.json())["choices"][0]["text"] == "decode"
            drop[0] = 2
            r = await client.post("/v1/completions", json=body)
            assert r.status == 502 and "did not answer" in (await r.text()), await r.text()
            n_dec = len(seen["decode"])
            r = await client.post("/v1/completions", json=dict(body, stream=True))
            assert r.status == 200 and r.content_type == "text/event-stream"
            assert await r.read() == b"".join(STREAM)
            assert seen["prefill"][-1]["stream"] is False and seen["decode"][-1]["stream"]
            fail[0] = True
            r = await client.post("/v1/completions", json=body)
            assert r.status == 400 and "too long" in (await r.text())
            assert len(seen["decode"]) == n_dec + 1
            r = await client.post("/v1/completions", data=b"{not json")
            assert r.status == 400 and "not JSON" in (await r.text())
        finally:
            await client.close()
            for s in servers.values():
                await s.close()

    asyncio.run(run())


def test_other_connectors_refused(tmp_path):
    """A KV connector other than the file tier's and kvarn's LMCache one,
    with a kvarn cache dtype: LLM(...) fails naming it and the served ones
    (checks.check_kv_connector; NixlConnector moved kvarn pages one block
    off, silently). Without an engine: what the check lets through."""
    from conftest import run_llm
    from test_offload import _ids
    p, _ = _ids()
    ktc = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    res, out = run_llm(dict(kv_cache_dtype=KV, prompt_ids=[p[:10]], max_tokens=2,
                            kv_transfer_config=ktc), expect_ok=False)
    assert res is None
    assert "STARTUP_ERROR" in out and "KV connector NixlConnector is not served" in out \
        and "KvarnFileSpec" in out and "KvarnLMCacheMPConnector" in out, out[-3000:]
    from kvarn_vllm.checks import check_kv_connector

    def cfg(dtype, **t):
        ktc = types.SimpleNamespace(kv_connector=t.get("name"),
                                    kv_connector_module_path=t.get("module"),
                                    kv_connector_extra_config=t.get("extra"))
        return types.SimpleNamespace(kv_transfer_config=ktc,
                                     cache_config=types.SimpleNamespace(cache_dtype=dtype))
    check_kv_connector(types.SimpleNamespace(kv_transfer_config=None))
    check_kv_connector(cfg(KV))
    check_kv_connector(cfg(KV, name="OffloadingConnector",
                           extra={"spec_module_path": "kvarn_vllm.offload"}))
    check_kv_connector(cfg(KV, name="KvarnLMCacheMPConnector", module="kvarn_vllm.lmcache_mp"))
    for bad in (dict(name="OffloadingConnector", extra={"spec_name": "CPUOffloadingSpec"}),
                dict(name="LMCacheMPConnector",
                     module="lmcache.integration.vllm.lmcache_mp_connector"),
                dict(name="MultiConnector")):
        with pytest.raises(ValueError, match=f"KV connector {bad['name']} is not served"):
            check_kv_connector(cfg("kvarn_int8", **bad))
