"""The staging pool's bookkeeping (python/kvarn_vllm/staging.py), without an
engine: which tile of a step gets a slot or a scratch page, what commits,
what is kept (sink) and freed, and the attention entry each query group
gets. Shapes follow vLLM's metadata: query_start_loc [n+1], seq_lens [n],
block_table [n, max_blocks]."""
import numpy as np
import pytest

from kvarn_vllm._lib import KvarnError, parse_format
from kvarn_vllm.staging import Staging, pool_bytes, pool_slots

G = 128


def step(st, q_lens, seq_lens, table):
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    p = st.plan(qsl, np.array(seq_lens, dtype=np.int32),
                np.array(table, dtype=np.int32), int(qsl[-1]))
    return p


def test_pool_size_is_sequences_times_sink_plus_tail():
    assert pool_slots(8, 1) == 16 and pool_slots(8, 0) == 8
    # SmolLM2: 30 layers, 3 KV heads, D 64: one tile 2.95 MB, 8 x 2 of them
    # (the page size comes from kvarn_cache_plan; the product is written out)
    fmt = parse_format("kvarn_k4v2_g128", 64)
    assert pool_bytes(fmt, 30, 3, 64, 8, 1) == 16 * 30 * 3 * 2 * G * 64 * 2
    assert pool_bytes(fmt, 30, 3, 64, 8, 0) == 8 * 30 * 3 * 2 * G * 64 * 2
    fmt64 = parse_format("kvarn_k4v2_g64", 128)
    assert pool_bytes(fmt64, 2, 8, 128, 4, 1) == 8 * 2 * 8 * 2 * 64 * 128 * 2


def test_prefill_crossing_tiles_then_decode():
    st = Staging(n_slots=4, tile=G, sink_tiles=1, n_blocks=16, n_scratch=4)
    # 300 tokens in one chunk over blocks 5, 6, 7: tile 0 (sink) full -> slot,
    # committed and kept; tile 1 whole non-sink -> scratch page, committed;
    # tile 2 partial -> slot, not committed
    p = step(st, [300], [300], [[5, 6, 7, 0]])
    s0, s2 = st.slot_of[5], st.slot_of[7]
    assert s0 >= 0 and s2 >= 0 and st.slot_of[6] == -1
    assert p.n_scratch == 1
    scratch_page = st.n_slots  # the first page after the slots
    assert sorted(p.commit_pool) == sorted([(s0, 5), (scratch_page, 6)])
    assert list(p.store_slots[:2]) == [s0 * G, s0 * G + 1]
    assert p.store_slots[128] == scratch_page * G and p.store_slots[299] == s2 * G + 43
    # attention entries: one per tile group, own tile at index t
    assert [g[1] for g in p.groups] == [0, 1, 2]
    assert list(p.g_len) == [128, 256, 300] and list(p.g_committed) == [0, 1, 2]
    assert list(p.g_tables[2, :3]) == [s0, 6, s2]   # sink slot, record, tail slot
    assert list(p.g_tables[1, :2]) == [s0, scratch_page]
    st.finish(p)
    assert st.committed[5] and st.committed[6] and not st.committed[7]
    assert st.slot_of[5] == s0  # the sink keeps its fp16 copy
    # decode the 301st token: tail slot, nothing commits
    p = step(st, [1], [301], [[5, 6, 7, 0]])
    assert p.store_slots[0] == s2 * G + 44 and not p.commit_pool
    assert p.g_len[0] == 301 and list(p.g_tables[0, :3]) == [s0, 6, s2]


def test_tail_slot_freed_when_its_tile_commits():
    st = Staging(n_slots=2, tile=G, sink_tiles=1, n_blocks=8, n_scratch=2)
    st.finish(step(st, [200], [200], [[1, 2]]))
    s = st.slot_of[2]
    p = step(st, [56], [256], [[1, 2]])          # fills tile 1 exactly
    assert (s, 2) in p.commit_pool and s in p.free_after
    st.finish(p)
    assert st.slot_of[2] == -1 and st.committed[2] and s in st.free


def test_committed_block_is_never_written_again():
    """vLLM recomputing the last token of a fully cached prompt: the token
    lands in a committed block; it is not stored, and it reads the tile
    from the record (committed_tiles covers its own tile)."""
    st = Staging(n_slots=2, tile=G, sink_tiles=0, n_blocks=8, n_scratch=2)
    st.finish(step(st, [256], [256], [[3, 4]]))
    assert st.committed[3] and st.committed[4]
    p = step(st, [1], [256], [[3, 4]])
    assert p.store_slots[0] == -1 and not p.commit_pool
    assert p.groups[0][5] == "record" and p.g_committed[0] == 2
    assert list(p.g_tables[0, :2]) == [3, 4]


def test_reset_blocks_forgets_slots_and_records():
    st = Staging(n_slots=2, tile=G, sink_tiles=1, n_blocks=8, n_scratch=2)
    st.finish(step(st, [130], [130], [[1, 2]]))
    n_free = len(st.free)
    st.reset_blocks([1, 2])
    assert st.slot_of[1] == -1 and st.slot_of[2] == -1 and not st.committed[1]
    assert len(st.free) == n_free + 2


def test_reclaim_frees_blocks_no_running_request_holds():
    st = Staging(n_slots=2, tile=G, sink_tiles=1, n_blocks=8, n_scratch=2)
    st.finish(step(st, [10], [10], [[1]]))        # request A: block 1
    st.finish(step(st, [10], [10], [[2]]))        # request B: block 2
    st.live_blocks = lambda: {2}                  # A finished, B runs
    p = step(st, [10], [10], [[3]])               # request C needs a slot
    assert st.slot_of[3] >= 0 and st.slot_of[1] == -1 and st.slot_of[2] >= 0
    assert p.store_slots[0] == st.slot_of[3] * G


def test_exhausted_pool_is_a_clear_error():
    st = Staging(n_slots=1, tile=G, sink_tiles=1, n_blocks=8, n_scratch=1)
    st.live_blocks = lambda: {1}
    st.finish(step(st, [10], [10], [[1]]))
    with pytest.raises(KvarnError, match="staging pool"):
        step(st, [10], [10], [[2]])


def test_more_whole_tiles_than_scratch_is_a_clear_error():
    st = Staging(n_slots=2, tile=G, sink_tiles=0, n_blocks=8, n_scratch=1)
    with pytest.raises(KvarnError, match="scratch"):
        step(st, [384], [384], [[1, 2, 3]])


def test_sink_shorter_than_a_tile():
    """KVARN_SINK_TOKENS = 16 (sink_tiles 0, r 16): tile 0 is an ordinary
    tile; when it commits, its page's first 16 rows are copied into a sink
    slot keyed by its block, and every later query group reads that slot
    (g_sink_slot); the slot goes when vLLM hands the block out again."""
    st = Staging(n_slots=2, tile=G, sink_tiles=0, n_blocks=16, n_scratch=4,
                 sink_partial=16, n_sink_slots=2)
    p = step(st, [300], [300], [[5, 6, 7]])
    scratch0 = st.n_slots                   # tile 0, whole in the chunk: scratch
    ss = int(st.sslot_of[5])
    assert ss >= 0 and p.sink_copies == [(scratch0, ss)]
    assert (scratch0, 5) in p.commit_pool   # tile 0 is committed like any tile
    assert p.sink_slot[0] == ss
    by_tile = {g[1]: j for j, g in enumerate(p.groups)}
    assert p.g_sink_slot[by_tile[0]] == -1  # its own tile, still fp16
    assert p.g_sink_slot[by_tile[1]] == ss and p.g_sink_slot[by_tile[2]] == ss
    assert p.g_sink.all()
    st.finish(p)
    p = step(st, [1], [301], [[5, 6, 7]])   # decode: the slot stays
    assert p.sink_copies == [] and p.g_sink_slot[0] == ss
    st.reset_blocks([5])
    assert st.sslot_of[5] == -1 and ss in st.sfree


def test_sink_slot_lost_reads_records():
    """No sink slot left for a sequence's committed tile S (taken back by
    reclaim): the sequence reads every full tile from its record, sink
    tiles included (has_sink False, tables point at blocks)."""
    st = Staging(n_slots=4, tile=G, sink_tiles=1, n_blocks=16, n_scratch=4,
                 sink_partial=16, n_sink_slots=1)
    p = step(st, [300], [300], [[5, 6, 7]])  # S = 144: tile 0 sink, 16 of tile 1
    assert p.sink_slot[0] == st.sslot_of[6] >= 0
    st.finish(p)
    st._release_sink(int(st.sslot_of[6]))
    p = step(st, [1], [301], [[5, 6, 7]])
    assert not p.has_sink[0] and not p.g_sink.any()
    assert list(p.tables[0, :2]) == [5, 6]  # records, not the sink page
