"""Prefixes offloaded to a file tier and shared between vLLM processes
(kvarn_vllm.offload.KvarnFileSpec through vLLM's OffloadingConnector;
docs/vllm-connectors.md).

For kvarn_k4v2_g128 (KVarN tiles, staging pool and sink), kvarn_int8
(per-token records) and auto (vLLM's own fp32 pages, the control), each in
a temporary root:
- engine A (connector on, empty root) runs prompts P (300 tokens: two whole
  blocks and a partial one) and Q (384 tokens, other text: block-aligned)
  and stores their whole blocks;
- engine B, a fresh process on the same root, runs P, then Q in a second
  generate call: P's two blocks are loaded (num_cached_tokens 256); Q is a
  whole-prompt hit: vLLM would recompute its last token inside Q's last
  loaded block (sched/scheduler.py:3172); for KVarN the kvarn scheduler
  loads Q's first two blocks only and recomputes the last tile
  (scheduler.whole_tile_hits; without it Q's first logprob was 0.95 nat
  off the cold run's), and one of Q's loaded blocks is one that P used
  just before, its staging slot still set (vLLM does not report a loaded
  block for zeroing, scheduler.py:1264): the log shows it released
  (Staging.adopt_loaded);
- engine C, a cold run without the connector, runs P then Q the same way
  (for kvarn_int8 with Q's last row in a step of its own, as B computes
  it: cold_cfg says why).
B's greedy tokens equal C's and its logprobs are within LP_TOL of C's
(auto: C is A, which ran with the connector but found nothing). The files
are one per whole block of the bytes of the cache's page of every layer:
layers x Hk x record bytes (_lib.record_bytes) for KVarN, layers x Hk x
128 x token-record bytes for per-token, layers x 2 x 128 x Hk x D x 4 for
fp32; a KVarN sink block also has its staged copy (int8 staging: layers x
Hk x 128 x (2D + 8)). Printed against bf16's 2 Hk D 2 layers per token.

Without an engine (the staging bookkeeping the loads go through): a
loaded block that held a previous user's slot, whose last token is then
recomputed, is read from its record, not from that slot, and nothing is
committed again (Staging.adopt_loaded; these fail with the slot left
set); a sink tile's staged copy goes through state.sink_pages /
queue_loaded / apply_loaded into a fresh sink slot byte for byte.

A configuration the tier refuses (speculative decoding, KVARN_SINK_TOKENS)
fails at LLM(...) with the tier's message.
"""
import glob
import re
import os

import pytest

from conftest import ROOT, run_llm

LAYERS, HK, D = 30, 3, 64          # SmolLM2-135M
AUSTEN = os.path.join(ROOT, "data", "austen", "persuasion.txt")
LP_TOL = 1e-4                      # logprobs of B against the cold run
BF16_PER_TOKEN = 2 * HK * D * 2 * LAYERS


def _ids():
    from transformers import AutoTokenizer
    from conftest import HF_MODEL
    tok = AutoTokenizer.from_pretrained(HF_MODEL)
    with open(AUSTEN, encoding="utf-8") as f:
        text = f.read()
    p = tok(text[2000:6000]).input_ids[:300]
    q = tok(text[40000:46000]).input_ids[:384]
    assert len(p) == 300 and len(q) == 384
    return p, q


def _ktc(root):
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "KvarnFileSpec",
                                          "spec_module_path": "kvarn_vllm.offload",
                                          "root": root}}


def _cfg(dtype, p, q, root=None, **kw):
    c = dict(kv_cache_dtype=dtype, prompt_ids=[p], rounds=[{"prompt_ids": [q], "logprobs": 1}],
             max_tokens=8, logprobs=1, prefix_caching=True, max_num_seqs=2,
             kv_cache_memory_bytes=256 << 20)
    if root is not None:
        c["kv_transfer_config"] = _ktc(root)
    c.update(kw)
    return c


def _outs(res):
    """[P's output, Q's output] of a run_llm result."""
    return [res["outputs"][0], res["rounds"][0][0]]


def _block_bytes(dtype) -> int:
    """Bytes of one vLLM block (128 tokens) of every layer, by hand."""
    from kvarn_vllm import _lib
    if dtype == "auto":
        return LAYERS * 2 * 128 * HK * D * 4                # fp32 K and V
    fmt = _lib.parse_format(dtype, D)
    rb = _lib.record_bytes(fmt, D)
    return LAYERS * HK * (rb if fmt.per_tile else 128 * rb)  # tile records or token records


def cold_cfg(dtype, cfg):
    """The cold run's configuration from B's (also test_lmcache): no
    connector; for a per-token format a step budget of len(Q) - 1 tokens,
    so that Q's last row is computed alone, as B computes it after its
    whole-prompt hit (the tile format recomputes Q's last tile, 128 rows,
    in both). vLLM's fp32 weight matmuls are not the same bits for every
    row count (torch 2.13's MKL on a Sapphire Rapids Xeon: a row computed
    alone differs from it among 16 or more by ~1e-6 relative), and
    kvarn_int8's per-token rounding of that row's K and V moved Q's
    logprobs by up to 1.9e-2 against a cold run that prefilled Q whole."""
    from kvarn_vllm import _lib
    c = {k: v for k, v in cfg.items() if k != "kv_transfer_config"}
    if _lib.is_per_token_dtype(dtype):
        c["max_num_batched_tokens"] = len(cfg["rounds"][0]["prompt_ids"][0]) - 1
    return c


def equals_cold(dtype, b, cold):
    """P's and Q's outputs of run b against the cold run's: greedy tokens
    equal, logprobs within LP_TOL (also test_lmcache)."""
    for name, x, y in zip("PQ", _outs(b), _outs(cold)):
        assert x["token_ids"] == y["token_ids"], (name, x["token_ids"], y["token_ids"])
        d = max(abs(x["logprobs"][i][str(t)] - y["logprobs"][i][str(t)])
                for i, t in enumerate(y["token_ids"]))
        print(f"{dtype} {name}: {len(y['token_ids'])} greedy tokens equal, cached "
              f"{x['num_cached_tokens']}, largest logprob difference {d:.2e}")
        assert d <= LP_TOL


@pytest.fixture(scope="module")
def ids(hf_model):
    return _ids()


@pytest.mark.parametrize("dtype", ["kvarn_k4v2_g128", "kvarn_int8", "auto"])
def test_shared_prefix(dtype, ids, tmp_path):
    p, q = ids
    root = str(tmp_path / "kv")
    a, _ = run_llm(_cfg(dtype, p, q, root))
    files = sorted(glob.glob(os.path.join(root, "*", "*.blk")))
    sinks = sorted(glob.glob(os.path.join(root, "*", "*.sink")))
    # (c) one file per whole block of P and Q, each the page bytes of every layer
    assert len(files) == 5, files   # P: 2 whole blocks, Q: 3
    want = _block_bytes(dtype)
    sizes = {os.path.getsize(f) for f in files}
    assert sizes == {want}, (sizes, want)
    per_token = want / 128
    print(f"{dtype}: {want} bytes per stored block = {per_token:.0f} B/token, bf16 "
          f"{BF16_PER_TOKEN} B/token ({BF16_PER_TOKEN / per_token:.2f}x smaller)")
    if dtype == "kvarn_k4v2_g128":
        # the sink tile of P and of Q: its int8-staged copy beside the block
        assert len(sinks) == 2, sinks
        assert {os.path.getsize(s) for s in sinks} == {LAYERS * HK * 128 * (2 * D + 8)}
    else:
        assert sinks == []
    # (a), (b): a fresh engine on the same root
    b, log_b = run_llm(_cfg(dtype, p, q, root))
    bp, bq = _outs(b)
    assert bp["num_cached_tokens"] == 256, bp["num_cached_tokens"]
    # a whole-prompt hit: KVarN tiles recompute Q's last tile (scheduler.py
    # whole_tile_hits), the others its last token
    tile = dtype == "kvarn_k4v2_g128"
    assert bq["num_cached_tokens"] == (256 if tile else 384), bq["num_cached_tokens"]
    if tile:
        # the stale-slot case ran: a loaded block still held a slot
        stale = [int(m) for m in re.findall(r"adopted as records \((\d+) held", log_b)]
        print(f"{dtype}: loaded blocks that held a previous user's slot: {stale}")
        assert sum(stale) >= 1, stale
    cold = a if dtype == "auto" else run_llm(cold_cfg(dtype, _cfg(dtype, p, q)))[0]
    equals_cold(dtype, b, cold)


@pytest.mark.parametrize("what,kw,env,msg", [
    ("speculation", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                            "prompt_lookup_max": 3}}, {},
     "speculative decoding"),
    ("sink tokens", {}, {"KVARN_SINK_TOKENS": "64"}, "KVARN_SINK_TOKENS=64"),
])
def test_refused(what, kw, env, msg, ids, tmp_path, monkeypatch):
    """(d) a configuration the tier does not serve fails at LLM(...) with
    its message (offload.check_config, from platform.py)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    p, q = ids
    res, out = run_llm(_cfg("kvarn_k4v2_g128", p[:10], q[:10], str(tmp_path / "kv"), **kw),
                       expect_ok=False)
    assert res is None
    assert "STARTUP_ERROR" in out and msg in out and "KvarnFileSpec" in out, out[-3000:]


G = 128


def _plan(st, q_lens, seq_lens, table):
    import numpy as np
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return st.plan(qsl, np.array(seq_lens, dtype=np.int32), np.array(table, dtype=np.int32),
                   int(qsl[-1]))


def _finish(st, p):
    st.finish(p)


def test_loaded_block_with_stale_slot_reads_its_record():
    """P (200 tokens, blocks 1 and 2: block 2's tail holds a slot) ends;
    block 2 is handed to a request whose two loaded blocks are [3, 2] and
    whose last token (255) is recomputed: with adopt_loaded it reads tile 1
    from block 2's record and commits nothing; block 2's stale slot was
    the previous user's tail (what it would read otherwise)."""
    from kvarn_vllm.staging import Staging
    st = Staging(4, G, 1, 8, n_scratch=3)
    p = _plan(st, [200], [200], [[1, 2]])
    _finish(st, p)
    stale = int(st.slot_of[2])
    assert stale >= 0 and not st.is_sink[stale]
    st.adopt_loaded([3, 2])
    assert st.slot_of[2] == -1 and st.slot_of[3] == -1 and stale in st.free
    assert st.committed[2] and st.committed[3]
    p = _plan(st, [1], [256], [[3, 2]])
    assert p.commit_pool == [] and (p.store_slots == -1).all()
    (_, t, _, _, off0, where, page), = p.groups
    assert (t, off0, where, page) == (1, 127, "record", 2), p.groups


def test_loaded_fresh_block_is_not_committed_again():
    """A loaded block never used before (no slot), its last token
    recomputed: without the committed mark the plan would stage the token
    in a scratch page and commit the tile from that mostly empty page."""
    from kvarn_vllm.staging import Staging
    st = Staging(4, G, 1, 8, n_scratch=3)
    st.adopt_loaded([1, 2])
    p = _plan(st, [1], [256], [[1, 2]])
    assert p.commit_pool == [] and p.n_scratch == 0
    assert [g[5] for g in p.groups] == ["record"]


def test_sink_copy_round_trip(monkeypatch):
    """state.sink_pages of a sink slot (pool rows l * n_slots + s of every
    layer) through queue_loaded / apply_loaded lands in a fresh sink slot of
    another block, byte for byte, after the block's stale slot is released."""
    import torch
    from kvarn_vllm import state
    from kvarn_vllm.staging import Staging
    L, n_slots, n_scr = 3, 4, 3
    st = Staging(n_slots, G, 1, 8, n_scratch=n_scr)
    pool = torch.randint(0, 255, (L * n_slots + n_scr, 2, G, 8), dtype=torch.uint8)
    for k, v in (("staging", st), ("pool", pool), ("pool_layers", L), ("loaded", [])):
        monkeypatch.setattr(state._State, k, v)
    _finish(st, _plan(st, [200], [200], [[1, 2]]))      # block 1: sink slot, 2: tail
    s1 = int(st.slot_of[1])
    assert st.is_sink[s1]
    data = state.sink_pages(1)
    assert len(data) == L * 2 * G * 8
    assert state.sink_pages(2) is None                  # a tail slot is no sink
    state.queue_loaded(2, data)                         # block 2 now a loaded sink tile
    state.apply_loaded()
    s2 = int(st.slot_of[2])
    assert s2 >= 0 and s2 != s1 and st.is_sink[s2] and st.committed[2]
    assert state.sink_pages(2) == data and state._State.loaded == []
    for ly in range(L):
        assert torch.equal(pool[ly * n_slots + s2], pool[ly * n_slots + s1])


def test_file_manager_pins_and_skips(tmp_path):
    """The manager alone: a key is offloaded once its file exists, a stored
    key is not stored again, a load's pinned link survives the file's
    removal and is gone after complete_load; pins of a dead process are
    cleared by the next manager."""
    from vllm.v1.kv_offload.base import LookupResult
    from kvarn_vllm.offload import KvarnFileManager
    m = KvarnFileManager(str(tmp_path))
    k1, k2 = bytes(range(36)), bytes(range(1, 37))
    assert m.lookup(k1, None) is LookupResult.MISS
    out = m.prepare_store([k1, k2], None)
    assert out.keys_to_store == [k1, k2] and out.evicted_keys == []
    blk, sink = out.store_spec.files[0]
    assert blk == m.block_path(k1) and sink.endswith(".sink")
    with open(blk, "wb") as f:                      # what the worker writes
        f.write(b"records")
    assert m.lookup(k1, None) is LookupResult.HIT
    assert m.prepare_store([k1, k2], None).keys_to_store == [k2]
    (pinned, psink), = m.prepare_load([k1], None).files
    assert psink is None and os.path.dirname(pinned) == m.pin_dir
    os.unlink(blk)                                  # removed meanwhile
    with open(pinned, "rb") as f:
        assert f.read() == b"records"
    m.complete_load([k1], None)
    assert not os.path.exists(pinned)
    dead = tmp_path / "pins" / "999999999"
    dead.mkdir()
    (dead / "0.blk").write_bytes(b"x")
    KvarnFileManager(str(tmp_path))
    assert not dead.exists()


def test_parse_bytes():
    from kvarn_vllm.offload import parse_bytes
    assert parse_bytes(100) == 100 and parse_bytes("100") == 100
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("512 mib") == 512 << 20
    assert parse_bytes("1.5GB") == 1_500_000_000
    for bad in (0, -1, True, "abc", "5 parsecs", "-2GiB", "", None):
        with pytest.raises(ValueError, match="max_bytes"):
            parse_bytes(bad)


def test_file_manager_evicts_least_recently_used(tmp_path):
    """max_bytes: before a store the oldest-used unpinned blocks go (with
    their sink copies) and are reported evicted; a block a lookup found
    stays (pinned) until its request ends, whatever another process
    evicts; a hit makes a block recent; a file linked elsewhere (another
    process's pin) is never taken; where nothing can go, fewer blocks are
    stored."""
    import types
    from vllm.v1.kv_offload.base import LookupResult
    from kvarn_vllm.offload import KvarnFileManager
    B = 100
    m = KvarnFileManager(str(tmp_path), max_bytes=3 * B + 50, block_bytes=B)
    clock = [1_000_000_000_000]
    ctx = lambda rid: types.SimpleNamespace(req_id=rid, kv_transfer_params=None)

    def store(keys, sink=0):
        out = m.prepare_store(keys, ctx("s"))
        for k in out.keys_to_store:
            clock[0] += 10**9
            path = m.block_path(k)
            with open(path, "wb") as f:
                f.write(b"r" * B)
            os.utime(path, ns=(clock[0], clock[0]))
            if sink:
                with open(path[:-4] + ".sink", "wb") as f:
                    f.write(b"s" * sink)
        return out

    k = [bytes([i]) * 8 for i in range(8)]
    assert store(k[:3]).evicted_keys == []
    # request a finds k0: pinned, and k0 is now the most recent use
    assert m.lookup(k[0], ctx("a")) is LookupResult.HIT
    out = store([k[3]])
    assert out.keys_to_store == [k[3]] and out.evicted_keys == [k[1]]
    assert not os.path.exists(m.block_path(k[1]))
    # another process evicting everything it can: k0 stays (pinned), and
    # request a still loads it
    other = KvarnFileManager(str(tmp_path / "x"), max_bytes=1, block_bytes=B)
    other.dir = m.dir
    ev = other._make_room([k[7]])[1]
    assert k[0] not in ev and os.path.exists(m.block_path(k[0])), ev
    (blk, _), = m.prepare_load([k[0]], ctx("a")).files
    assert open(blk, "rb").read() == b"r" * B
    m.complete_load([k[0]], ctx("a"))
    m.on_request_finished(ctx("a"))
    # the oldest block goes with its sink copy, which counts in the size
    for f in glob.glob(os.path.join(m.dir, "*.blk")):
        os.unlink(f)
    m.max_bytes = 5 * B + 50
    for key, sink in ((k[4], 2 * B), (k[5], 0), (k[6], 0)):
        assert store([key], sink=sink).evicted_keys == []
    out = store([k[7]])                          # 500 + 100 > 550
    assert out.evicted_keys == [k[4]] and not glob.glob(os.path.join(m.dir, "*.sink"))
    # a hit makes a block recent: k6, not k5, goes next
    assert m.lookup(k[5], ctx("b")) is LookupResult.HIT
    m.on_request_finished(ctx("b"))
    assert store([k[0]]).evicted_keys == [] and store([k[1]]).evicted_keys == []
    assert store([k[2]]).evicted_keys == [k[6]]
    # every block linked elsewhere too (another process's pins): none is
    # taken, and fewer blocks are stored
    keep = tmp_path / "keep"
    keep.mkdir()
    for f in glob.glob(os.path.join(m.dir, "*.blk")):
        os.link(f, keep / os.path.basename(f))
    out = store([k[3], k[4]])                    # 500 + 200 > 550, 500 + 100 > 550
    assert out.evicted_keys == [] and out.keys_to_store == [], out
    m.max_bytes = 6 * B
    out = store([k[3], k[4]])
    assert out.evicted_keys == [] and out.keys_to_store == [k[3]], out
    assert m.stats["not_stored"] == 3
