"""The staging pool's bookkeeping (python/kvarn_vllm/staging.py), without an
engine: which tile of a step gets a slot or a scratch page, what commits,
what is kept (sink) and freed, and the attention entry each query group
gets. Shapes follow vLLM's metadata: query_start_loc [n+1], seq_lens [n],
block_table [n, max_blocks]."""
import numpy as np
import pytest

from kvarn_vllm._lib import (KvarnError, STAGING_FP8_E4M3, STAGING_INT4, STAGING_INT8,
                             parse_format)
from kvarn_vllm.staging import Staging, draft_tiles, pool_bytes, pool_size, pool_slots

G = 128


def step(st, q_lens, seq_lens, table, drafts=None):
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    p = st.plan(qsl, np.array(seq_lens, dtype=np.int32),
                np.array(table, dtype=np.int32), int(qsl[-1]),
                None if drafts is None else np.array(drafts, dtype=np.int32))
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


# bytes of one staged token-head record at D = 64 (include/kvarn/record.h):
# int8 D codes + fp16 scale and zero-point, for K and for V; fp8_e4m3 D
# codes + fp16 scale; int4 D/2 bytes of codes + fp16 scale and zero-point
RECORD_STAGINGS = [(STAGING_INT8, 2 * 64 + 8), (STAGING_FP8_E4M3, 2 * 64 + 4),
                   (STAGING_INT4, 64 + 8)]


@pytest.mark.parametrize("staging,rec", RECORD_STAGINGS)
def test_record_pool_and_shared_scratch_bytes(staging, rec):
    """A record staging (int8, fp8_e4m3, int4): its token record's bytes
    per token-head against fp16's 4D; scratch tiles ceil(batched / G) + 1
    of ONE layer (shared by the layers); sink slots r tokens of every
    layer."""
    fmt = parse_format("kvarn_k4v2_g128", 64)
    assert pool_bytes(fmt, 30, 3, 64, 8, 1, staging=staging) == 16 * 30 * 3 * G * rec
    ps = pool_size(fmt, 30, 3, 64, 8, 1, staging=staging, max_batched_tokens=4096)
    assert ps["record_bytes"] == rec and ps["n_scratch"] == 4096 // G + 1
    assert ps["staging"] == staging
    assert ps["bytes"] == 16 * 30 * 3 * G * rec + 33 * 3 * G * rec
    ps = pool_size(fmt, 30, 3, 64, 8, 0, sink_partial=16, staging=staging,
                   max_batched_tokens=300)
    assert (ps["n_slots"], ps["n_sink_slots"], ps["n_scratch"]) == (8, 8, 4)
    assert ps["bytes"] == 8 * 30 * 3 * G * rec + 8 * 30 * 3 * 16 * rec + 4 * 3 * G * rec
    fp = pool_size(fmt, 30, 3, 64, 8, 1, max_batched_tokens=4096)
    assert fp["record_bytes"] == 0 and fp["bytes"] == (16 * 30 + 33) * 3 * 2 * G * 64 * 2


def test_slots_bounded_by_the_blocks_the_budget_leaves():
    """Far more sequences than the budget can give blocks to: the slots are
    capped at N = ceil((budget - scratch) / (page + block)), and the blocks
    the rest of the budget holds are <= N, so every live block can have its
    slot (a slot belongs to one block of a running sequence)."""
    fmt = parse_format("kvarn_k4v2_g128", 64)
    layers, hk = 30, 3
    block = layers * hk * 7296                      # one tile's records, every layer
    budget = 2**30
    free = pool_size(fmt, layers, hk, 64, 512, 1, staging=1, max_batched_tokens=4096)
    ps = pool_size(fmt, layers, hk, 64, 512, 1, staging=1, max_batched_tokens=4096,
                   budget=budget, block_bytes=block)
    page = ps["page_bytes"]
    scratch = 33 * hk * G * 136
    n = -(-(budget - scratch) // (page + block))
    assert free["n_slots"] == 1024 and ps["n_slots"] == n < 1024
    assert ps["bytes"] == n * page + scratch
    blocks = (budget - ps["bytes"]) // block
    assert blocks <= ps["n_slots"]
    # and not far above what is needed: two slots fewer would leave more
    # blocks than slots
    assert (budget - (n - 2) * page - scratch) // block > n - 2
    # a budget the pool does not bind: max_num_seqs x (sink + tail)
    small = pool_size(fmt, layers, hk, 64, 8, 1, staging=1, max_batched_tokens=4096,
                      budget=budget, block_bytes=block)
    assert small["n_slots"] == 16


def test_every_live_block_gets_a_slot_under_the_bound():
    """The bound at work: a pool of as many slots as blocks serves any set
    of running sequences over those blocks (each tail and sink tile its
    slot), sequences ending and others taking their blocks."""
    n_blocks = 6
    st = Staging(n_slots=n_blocks, tile=G, sink_tiles=1, n_blocks=n_blocks, n_scratch=2)
    live = set()
    st.live_blocks = lambda: set(live)
    # three 1-tile sequences (sink = tail): 3 slots
    live |= {0, 1, 2}
    p = step(st, [5, 5, 5], [5, 5, 5], [[0], [1], [2]])
    st.finish(p)
    # they end; one 2-tile-plus sequence takes blocks 3, 4, 5 (sink, record, tail)
    live.clear()
    live |= {3, 4, 5}
    p = step(st, [300], [300], [[3, 4, 5]])
    st.finish(p)
    # and two short ones on blocks 0, 1 alongside it: 2 + 2 slots live, the
    # three ended sequences' slots reclaimed
    live |= {0, 1}
    p = step(st, [1, 3, 3], [301, 3, 3], [[3, 4, 5], [0, 0, 0], [1, 0, 0]])
    st.finish(p)
    assert sum(1 for b in st.block_of if b >= 0) <= n_blocks


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


# -- speculative decoding: commit on acceptance ------------------------------

def test_pool_grows_by_the_tiles_drafts_reach():
    assert draft_tiles(0, G) == 0
    assert draft_tiles(1, G) == 1 and draft_tiles(5, G) == 1 and draft_tiles(127, G) == 1
    assert draft_tiles(128, G) == 2 and draft_tiles(300, G) == 3
    assert pool_slots(8, 1, 5, G) == 8 * 3 and pool_slots(8, 0, 0, G) == 8
    fmt = parse_format("kvarn_k4v2_g128", 64)
    assert pool_bytes(fmt, 30, 3, 64, 8, 1, 0, 5) == 24 * 30 * 3 * 2 * G * 64 * 2


def _decoding_at(st, L, table):
    """Prefill L tokens (one chunk), no drafts."""
    st.finish(step(st, [L], [L], [table]))


def test_tile_filled_by_drafts_is_provisional_until_accepted():
    st = Staging(n_slots=3, tile=G, sink_tiles=1, n_blocks=8, n_scratch=2)
    table = [1, 2, 3, 0]
    _decoding_at(st, 252, table)
    s1 = int(st.slot_of[2])
    # verify step: the last sampled token + 5 drafts at positions 252..257;
    # tile 1 fills at 255 with drafts (known = 253): encoded, not committed
    p = step(st, [6], [258], [table], drafts=[5])
    assert (s1, 2) in p.commit_pool and 2 not in p.mark_committed
    assert p.mark_provisional == [2] and s1 not in p.free_after
    # the drafts in tile 2 read tile 1 from the record, as a plain run would
    j = [g[1] for g in p.groups].index(2)
    assert p.g_committed[j] == 2 and p.g_tables[j, 1] == 2
    st.finish(p)
    assert st.provisional[2] and not st.committed[2] and st.slot_of[2] == s1
    # one draft accepted: the step starts at 254, so tile 1's last two
    # positions are written again and the tile is encoded again
    p = step(st, [6], [260], [table], drafts=[5])
    assert p.confirmed == [] and st.stats["refilled"] == 1
    assert list(p.store_slots[:2]) == [s1 * G + 126, s1 * G + 127]
    assert (s1, 2) in p.commit_pool and p.mark_provisional == [2]
    st.finish(p)
    # all accepted: the next step starts at 260, past tile 1's end, so it is
    # committed (no new encode: its slot did not change since) and its slot
    # goes back to the pool
    p = step(st, [1], [261], [table], drafts=[0])
    assert p.confirmed == [2] and st.committed[2] and not st.provisional[2]
    assert st.slot_of[2] == -1 and s1 in st.free
    assert all(b != 2 for _, b in p.commit_pool)
    assert p.g_tables[0, 1] == 2 and p.g_committed[0] == 2
    st.finish(p)
    assert st.stats == {"provisional": 2, "refilled": 1, "confirmed": 1}


def test_tile_filled_by_known_tokens_commits_at_once():
    """Drafts start past the tile's end: the tile is committed in the step
    (its tokens are the accepted ones), as without speculation."""
    st = Staging(n_slots=3, tile=G, sink_tiles=1, n_blocks=8, n_scratch=2)
    table = [1, 2, 3, 0]
    _decoding_at(st, 255, table)
    s1 = int(st.slot_of[2])
    p = step(st, [6], [261], [table], drafts=[5])     # known = 256
    assert 2 in p.mark_committed and p.mark_provisional == []
    # its slot goes to the drafts' tile (block 3), staged in scratch for
    # this step and copied into the slot after each layer's attention
    assert s1 not in p.free_after and p.handoffs == [(st.n_slots, s1)]
    assert st.slot_of[3] == s1 and st.slot_of[2] == -1 and st.block_of[s1] == 3
    assert [g[5:] for g in p.groups if g[1] == 1] == [("pool", s1)]       # block 2
    assert [g[5:] for g in p.groups if g[1] == 2] == [("scratch", st.n_slots)]  # block 3


def test_whole_tile_of_drafts_takes_a_slot_not_scratch():
    """A whole non-sink tile inside the step is staged in a scratch page and
    committed at once only when its tokens are known; with drafts in it, it
    takes a slot (it must outlive the step) and is provisional."""
    st = Staging(n_slots=4, tile=G, sink_tiles=1, n_blocks=8, n_scratch=2)
    table = [1, 2, 3, 0]
    _decoding_at(st, 128, table)
    p = step(st, [200], [328], [table], drafts=[150])  # known = 178
    assert p.n_scratch == 0 and st.slot_of[2] >= 0
    assert p.mark_provisional == [2] and 2 not in p.mark_committed


def test_sink_tile_filled_by_drafts_keeps_its_slot_and_sink_copy():
    st = Staging(n_slots=3, tile=G, sink_tiles=0, n_blocks=8, n_scratch=2,
                 sink_partial=16, n_sink_slots=1)
    table = [1, 2, 0]
    _decoding_at(st, 125, table)
    p = step(st, [6], [131], [table], drafts=[5])     # tile 0 fills with drafts
    ss = int(st.sslot_of[1])
    assert p.sink_copies == [(int(st.slot_of[1]), ss)] and p.mark_provisional == [1]
    st.finish(p)
    p = step(st, [6], [132], [table], drafts=[5])     # rejected from 126 on
    assert p.sink_copies == [(int(st.slot_of[1]), ss)]  # the same sink slot
    assert st.sfree == []


@pytest.mark.parametrize("k", [1, 5, 127, 128, 200])
def test_random_acceptance_never_commits_a_rejected_token(k):
    """One sequence decoding with k drafts a step and a random number of
    them accepted, in a pool sized by pool_slots(1, 1, k): the pool never
    runs out, every committed tile was committed when all its positions were
    accepted (start of a step at or past its end, or filled by known tokens),
    and a tile is provisional only while a draft in it is unverified."""
    rng = np.random.default_rng(k)
    n_blocks = 64
    st = Staging(n_slots=pool_slots(1, 1, k, G), tile=G, sink_tiles=1, n_blocks=n_blocks,
                 n_scratch=2)
    st.live_blocks = lambda: set(range(n_blocks))
    table = np.arange(1, n_blocks, dtype=np.int32)[None, :]
    L0 = 100
    st.finish(step(st, [L0], [L0], table))
    while L0 + k + 1 < (n_blocks - 2) * G:
        q = 1 + k
        p = step(st, [q], [L0 + q], table, drafts=[k])
        known = L0 + 1
        for b in p.confirmed:
            t = int(np.nonzero(table[0] == b)[0][0])
            assert (t + 1) * G <= L0
        for b in p.mark_committed:
            t = int(np.nonzero(table[0] == b)[0][0])
            assert (t + 1) * G <= known
        st.finish(p)
        L0 = known + int(rng.integers(0, k + 1))     # accepted drafts
    assert st.stats["confirmed"] > 0 and st.stats["provisional"] > 0
    if k < G:
        assert st.stats["refilled"] > 0


def _serve(st, n_seqs, prompt, gen, budget, blocks_per_seq):
    """vLLM 0.32's scheduler, as far as the pool sees it: requests admitted
    in order up to n_seqs, every step the running ones first in admission
    order (a decoding one 1 token, a prefilling one the rest of its prompt
    up to the budget left, so a cut prompt resumes mid-tile), then new ones
    while the budget lasts; each step planned and finished. Returns the
    most slots any step's plan held (its own and those freed after it)."""
    done = [0] * n_seqs          # tokens computed
    table = [[i * blocks_per_seq + j for j in range(blocks_per_seq)] for i in range(n_seqs)]
    most = 0
    while min(done) < prompt + gen:
        left, q_lens, seqs = budget, [], []
        for i in range(n_seqs):
            if done[i] >= prompt + gen or left == 0:
                continue
            q = 1 if done[i] >= prompt else min(prompt - done[i], left)
            q_lens.append(q)
            seqs.append(i)
            left -= q
        p = step(st, q_lens, [done[i] + q for i, q in zip(seqs, q_lens)],
                 [table[i] for i in seqs])
        most = max(most, st.n_slots - len(st.free))
        st.finish(p)
        for i, q in zip(seqs, q_lens):
            done[i] += q
    return most


@pytest.mark.parametrize("budget", [300, 2 * G + 1, 4096])
def test_chunked_prefill_resuming_mid_tile_fits_the_pool(budget):
    """A prompt cut mid-tile by the step's token budget resumes in the next
    step, completing that tile and starting another: for that step both
    tiles are staged (the full one is read by its own queries and
    committed). The pool of max_num_seqs x (sink + 1) slots must still
    serve every sequence at once (8 sequences of 7552 tokens at 4096
    batched tokens exhausted it: the resumed chunk's new tile took a 17th
    slot): the new tile is staged in the step's scratch and takes over the
    completed tile's slot after the step."""
    from kvarn_vllm.staging import scratch_tiles
    n, prompt, gen = 4, 5 * G + 37, G + 5
    per = -(-(prompt + gen) // G)
    st = Staging(n_slots=pool_slots(n, 1), tile=G, sink_tiles=1, n_blocks=n * per,
                 n_scratch=scratch_tiles(budget, G))
    most = _serve(st, n, prompt, gen, budget, per)
    assert most <= pool_slots(n, 1)


# -- a prefill chunk's whole tiles: committed from the exact K/V --------------

def test_commit_rows_mark_whole_tiles_of_known_tokens():
    """commit_rows (parallel to commit_pool) gives the step's token index of
    a tile's first token where every token of the tile is a known token of
    this step (a prefill chunk's whole tile: the sink tile in its slot, a
    non-sink one in scratch), -1 where the tile was begun in an earlier step
    (a chunk boundary inside it) or filled by a decode step."""
    st = Staging(n_slots=4, tile=G, sink_tiles=1, n_blocks=16, n_scratch=4)
    table = [5, 6, 7, 8, 0]
    # chunk 1: [0, 300): tile 0 (sink) and tile 1 whole, tile 2 begun
    p = step(st, [300], [300], [table])
    assert dict(zip(p.commit_pool, p.commit_rows)) == {(st.slot_of[5], 5): 0,
                                                       (st.n_slots, 6): G}
    st.finish(p)
    # chunk 2: [300, 520) behind a decoding sequence: tile 2 completes (begun
    # in chunk 1: from its staged copy), tile 3 [384, 512) whole
    st.finish(step(st, [10], [10], [[9]]))
    p = step(st, [1, 220], [11, 520], [[9, 0, 0, 0, 0], table])
    rows = {b: r for (_, b), r in zip(p.commit_pool, p.commit_rows)}
    assert rows == {7: -1, 8: 1 + (3 * G - 300)}   # row 1 + 84: the chunk's index
    assert len(p.commit_rows) == len(p.commit_pool)
    st.finish(p)
    # decode steps filling tile 4 [512, 640): from its staged copy
    st2 = Staging(n_slots=4, tile=G, sink_tiles=1, n_blocks=16, n_scratch=4)
    st2.finish(step(st2, [G - 1], [G - 1], [[1, 2]]))
    p = step(st2, [1], [G], [[1, 2]])
    assert p.commit_pool == [(st2.slot_of[1], 1)] and p.commit_rows == [-1]


def test_commit_rows_never_mark_drafts():
    """Speculative decoding: a tile filled (even wholly, from its first
    position) with any draft token is provisional and never marked; once
    its tokens are accepted it is confirmed, not re-encoded."""
    st = Staging(n_slots=4, tile=G, sink_tiles=1, n_blocks=8, n_scratch=2)
    table = [1, 2, 3, 0]
    _decoding_at(st, 128, table)
    # verify step of 1 sampled token + 127 drafts: tile 1 [128, 256) lies
    # wholly in the step but holds drafts
    p = step(st, [128], [256], [table], drafts=[127])
    assert p.mark_provisional == [2] and p.commit_rows == [-1]
    st.finish(p)
    # a whole tile with its last token a draft
    st = Staging(n_slots=4, tile=G, sink_tiles=1, n_blocks=8, n_scratch=2)
    _decoding_at(st, 128, table)
    p = step(st, [G], [2 * G], [table], drafts=[1])
    assert p.commit_rows == [-1] and 2 in p.mark_provisional


def _engine_free_backend(monkeypatch, staging="int8", prefill_commit=None):
    """One kvarn attention layer of SmolLM2's shape (Hq 9, Hk 3, D 64),
    kvarn_k4v2_g128, driven without an engine: the plug-in's
    do_kv_cache_update and forward with vLLM's forward context stood in
    for, on CPU tensors. Returns (impl, layer, run) where run(chunks, total)
    feeds one sequence's tokens in prefill chunks and returns (K, V fp32
    [total, Hk * D], the layer's cache tensor, its block table)."""
    import types

    import torch
    from kvarn_vllm import backend as be

    monkeypatch.setenv("KVARN_STAGING", staging)
    if prefill_commit is None:
        monkeypatch.delenv("KVARN_PREFILL_COMMIT", raising=False)
    else:
        monkeypatch.setenv("KVARN_PREFILL_COMMIT", prefill_commit)
    for name, val in dict(layers=[], staging=None, plan=None, plan_meta=None, ops=None,
                          runner=None, max_num_seqs=2, max_batched_tokens=1024,
                          draft_tokens=0, kv_caches={}, n_impls=1, n_sliding=0,
                          pool_size=None, pool=None, pool_layers=0, staging_kind=0,
                          exact_commit=False).items():
        monkeypatch.setattr(be._State, name, val)
    Hq, Hk, D = 9, 3, 64
    fmt = parse_format("kvarn_k4v2_g128", D)
    impl = object.__new__(be.KvarnAttentionImpl)
    impl.fmt, impl.num_heads, impl.head_size, impl.num_kv_heads = fmt, Hq, D, Hk
    impl.scale, impl.sliding_window, impl.G = D ** -0.5, 0, fmt.tile_tokens
    impl.sink_tiles, impl.sink_partial, impl.sinks, impl.sink_param = 1, 0, None, None
    impl.layer_index, impl.pool_tensor, impl.per_token = None, None, False
    from kvarn_vllm.settings import Settings
    impl.settings = Settings.from_env()   # as the engine's configuration records them
    layer = types.SimpleNamespace(layer_name="model.layers.0.self_attn.attn")
    rb = _record_bytes(fmt, D)
    n_blocks = 8
    kv_cache = torch.zeros((n_blocks, Hk, G, rb // G), dtype=torch.uint8)
    table = torch.tensor([[3, 5, 1, 6, 2, 0, 0, 0]], dtype=torch.int32)

    def run(chunks, total):
        g = torch.Generator().manual_seed(7)
        K = torch.randn(total, Hk * D, generator=g) * 1.5 + 0.3
        V = torch.randn(total, Hk * D, generator=g)
        Q = torch.randn(total, Hq * D, generator=g)
        pos = 0
        for n in chunks:
            md = be.KvarnMetadata(num_actual_tokens=n, max_query_len=n,
                                  query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                                  seq_lens=torch.tensor([pos + n], dtype=torch.int32),
                                  block_table=table)
            ctx = types.SimpleNamespace(attn_metadata=md)
            monkeypatch.setattr("vllm.forward_context.get_forward_context", lambda: ctx)
            k, v, q = K[pos:pos + n], V[pos:pos + n], Q[pos:pos + n]
            impl.do_kv_cache_update(layer, k, v, kv_cache, None)
            out = torch.empty(n, Hq * D)
            impl.forward(layer, q, k, v, kv_cache, md, out)
            assert torch.isfinite(out).all()
            pos += n
        return K, V, kv_cache, table[0].tolist()
    return impl, layer, run


def _record_bytes(fmt, D):
    from kvarn_vllm._lib import record_bytes
    return record_bytes(fmt, D)


def _exact_records(K, V, tile, Hk=3, D=64):
    """kvarn_encode(prerotated = 0) of tile `tile` of the exact K/V, per KV
    head (emulate.Codec: the codec's own record of those values)."""
    import emulate
    c = emulate.Codec("kvarn_k4v2_g128", D)
    k = K[tile * G:(tile + 1) * G].view(G, Hk, D)
    v = V[tile * G:(tile + 1) * G].view(G, Hk, D)
    out = []
    for h in range(Hk):
        c.encode(k[:, h].numpy(), v[:, h].numpy())
        out.append(c.rec.copy())
    return out


def _records_of(kv_cache, block, Hk=3):
    rb = _record_bytes(parse_format("kvarn_k4v2_g128", 64), 64)
    return [kv_cache[block, h].reshape(-1)[:rb].numpy().copy() for h in range(Hk)]


@pytest.mark.parametrize("staging", ["int8", "fp16"])
def test_plugin_commits_whole_prefill_tiles_from_exact_kv(monkeypatch, staging):
    """The plug-in's store path end to end (backend.do_kv_cache_update and
    forward on the CPU kernels, no engine), one sequence of 4.5 tiles in two
    prefill chunks [0, 200), [200, 576): tile 0 (sink) and tile 2 lie wholly
    inside a chunk, tile 1 is cut by the boundary, tile 3 lies inside the
    second chunk. The committed records of tiles 0, 2 and 3 are byte for
    byte the codec's record of the exact K/V (kvarn_encode, prerotated = 0);
    tile 1's is not (committed from its staged copy)."""
    import numpy as np
    _, _, run = _engine_free_backend(monkeypatch, staging)
    K, V, kv_cache, table = run([200, 376], 576)
    from kvarn_vllm import backend as be
    assert be._State.exact_commit
    for t in range(4):
        got, want = _records_of(kv_cache, table[t]), _exact_records(K, V, t)
        same = [np.array_equal(a, b) for a, b in zip(got, want)]
        if t == 1:
            assert not all(same), "tile 1 (cut by the chunk boundary) committed exactly"
        else:
            assert all(same), f"tile {t}: record is not the exact K/V's"


def test_plugin_staged_prefill_commit_setting(monkeypatch):
    """KVARN_PREFILL_COMMIT=staged: every tile commits from its staged
    (int8) copy, as before the direct path: no whole tile's record is the
    exact K/V's."""
    import numpy as np
    _, _, run = _engine_free_backend(monkeypatch, "int8", prefill_commit="staged")
    K, V, kv_cache, table = run([576], 576)
    from kvarn_vllm import backend as be
    assert not be._State.exact_commit
    for t in range(4):
        got, want = _records_of(kv_cache, table[t]), _exact_records(K, V, t)
        assert not all(np.array_equal(a, b) for a, b in zip(got, want))
