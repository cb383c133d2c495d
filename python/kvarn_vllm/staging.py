"""The staging pool beside vLLM's pages: sink and tail tiles, keyed by
vLLM block id, and the per-step plan (which tiles receive tokens where,
which tiles commit). One Staging per worker process; block ids are shared
by every layer (vLLM allocates a block in all layers at once), so the
bookkeeping is done once per step (at the first layer). Staged tokens are
fp16 rows or token records of a per-token format (int8, fp8_e4m3, int4;
KVARN_STAGING, include/kvarn/paged.h "Staging").

Sizing (docs/vllm.md "Capacity"), all of it taken out of vLLM's KV budget:
  - slots, one tile of every layer each: a running sequence holds at most
    sink_tiles + 1 (its sink tiles and its partial tail tile; a chunk that
    completes the tail tile and starts another stages the new one in the
    step's scratch and hands the completed tile's slot to it after each
    layer's attention, _hand_over), so
    max_num_seqs * (sink_tiles + 1); with speculative decoding of k draft
    tokens a step, k // G + 1 more per sequence (the tiles the drafts reach,
    held until their tokens are accepted: "Speculative decoding" in
    docs/vllm-models.md). And never more than the blocks the budget leaves: a slot
    belongs to one block of a running sequence (a slot of a block no
    running sequence holds is reclaimed before the pool is short), so
    slots <= vLLM's block count, which pool_size makes hold by taking
    N = ceil(budget / (slot page + block)) slots at most (then the blocks
    left, (budget - N * slot page) / block, are <= N);
  - sink slots (a sink shorter than a tile): one per running sequence,
    max_num_seqs, and at most the same N;
  - scratch tiles, one tile each, shared by all layers (a layer's whole
    tiles are stored, committed and attended before the next layer runs):
    the whole tiles of one step, at most max_num_batched_tokens // G + 1.
Full non-sink tiles of a prefill chunk never take a slot: they are staged
in the scratch and committed at once. A tile all of whose tokens are known
(not draft) tokens of one step, a prefill chunk's whole tile, sink tiles
included, is marked in the plan (commit_rows) so that the backend can
commit it from the step's exact K/V rather than from its staged copy (CPU
kernels: kvarn_paged_commit_exact); the staged copy is still written, for
the tile's own queries. Sink slots of blocks that only
vLLM's prefix cache still holds are reclaimed when the pool runs short (the
tile's record, committed like every full tile, serves them from then on).
"""
import numpy as np

from . import _lib


def draft_tiles(draft_tokens: int, tile: int) -> int:
    """Extra slots per sequence under speculative decoding with draft_tokens
    (k) drafts a step: the uncommitted tiles of a sequence are those holding
    positions [L0, L0 + k + 1) for its first unaccepted position L0 (a step
    writes at most k + 1 tokens, and a rejection moves L0 back no further
    than one past the previous step's L0), at most k // G + 2 tiles against 1
    without drafts."""
    return 0 if draft_tokens <= 0 else draft_tokens // tile + 1


def pool_slots(max_num_seqs: int, sink_tiles: int, draft_tokens: int = 0,
               tile: int = 128) -> int:
    return max_num_seqs * (sink_tiles + 1 + draft_tiles(draft_tokens, tile))


def scratch_tiles(max_batched_tokens: int, tile: int) -> int:
    """Scratch tiles of a step: the whole tiles inside its chunks, at most
    max_batched_tokens // G (the step's tokens), plus one."""
    return -(-max_batched_tokens // tile) + 1 if max_batched_tokens > 0 else 0


def sink_slot_count(max_num_seqs: int, sink_partial: int) -> int:
    """Sink slots (a sink shorter than a tile, r = sink_partial tokens of
    tile sink_tiles kept staged): one per running sequence, none if r = 0."""
    return max_num_seqs if sink_partial > 0 else 0


def pool_size(fmt, n_layers: int, n_kv_heads: int, head_dim: int, max_num_seqs: int,
              sink_tiles: int, sink_partial: int = 0, draft_tokens: int = 0,
              staging: int = 0, max_batched_tokens: int = 0, budget: int = 0,
              block_bytes: int = 0) -> dict:
    """The pool's parts (module docstring "Sizing"): n_slots, n_sink_slots,
    n_scratch, bytes (everything: slots x one page of every layer, sink
    slots, scratch tiles x one layer's page), page_bytes, sink_bytes,
    record_bytes (one staged token-head record of a record staging; 0 for
    fp16), staging, as
    kvarn_cache_plan sizes them (_lib.staged_bytes). budget (bytes) and
    block_bytes (one vLLM block of every layer): the KV budget the pool is
    taken from, for the slots <= blocks bound; 0: no bound."""
    page, slot, rec = _lib.staged_bytes(fmt, n_layers, n_kv_heads, head_dim, sink_tiles,
                                        sink_partial, staging)
    n_slots = pool_slots(max_num_seqs, sink_tiles, draft_tokens, fmt.tile_tokens)
    n_sink = sink_slot_count(max_num_seqs, sink_partial)
    n_scr = scratch_tiles(max_batched_tokens, fmt.tile_tokens)
    scratch = n_scr * (page // n_layers)
    if budget > 0 and block_bytes > 0:
        bound = max(1, -(-max(0, budget - scratch) // (page + block_bytes)))
        n_slots, n_sink = min(n_slots, bound), min(n_sink, bound)
    return {"n_slots": n_slots, "n_sink_slots": n_sink, "n_scratch": n_scr,
            "bytes": n_slots * page + n_sink * slot + scratch,
            "page_bytes": page, "sink_bytes": slot, "record_bytes": rec, "staging": staging}


def pool_bytes(fmt, n_layers: int, n_kv_heads: int, head_dim: int,
               max_num_seqs: int, sink_tiles: int, sink_partial: int = 0,
               draft_tokens: int = 0, staging: int = 0, max_batched_tokens: int = 0) -> int:
    """Bytes of the staging pool without the blocks bound (pool_size)."""
    return pool_size(fmt, n_layers, n_kv_heads, head_dim, max_num_seqs, sink_tiles,
                     sink_partial, draft_tokens, staging, max_batched_tokens)["bytes"]


class StepPlan:
    """What one model step does to the cache, worked out at its first layer.

    Attention is planned per (sequence, tile) group of queries: the queries
    of tile t see tiles < t as the cache holds them once this step's full
    tiles are committed (records; sink tiles in fp16), the tokens of tile t
    before them in fp16 (its staging slot or scratch tile), and themselves
    exactly: what each would see were the tokens decoded one at a time, so
    the result does not depend on chunking or on prefix-cache hits."""

    def __init__(self):
        self.store_slots = None      # int64 [n_tokens]: kvarn slot (page * G + offset) or -1
        self.n_scratch = 0           # scratch tiles used
        self.tables = None           # int32 [n_seqs, max_tiles]: kvarn ids of full tiles
        self.has_sink = None         # bool [n_seqs]: sink tiles still in fp16
        self.groups = []             # (seq, t, q0, q1, off0, where, page): queries
                                     # [q0, q1) at offsets off0.. of tile t; where
                                     # "pool"/"scratch"/"record", page its id
        self.commit_pool = []        # (page, block) pairs to commit (slots and scratch)
        self.commit_rows = []        # per commit_pool entry: the step's token index of
                                     # the tile's first token when all G of its tokens
                                     # are known tokens of this step (a prefill chunk's
                                     # whole tile: it may commit from their exact K/V,
                                     # kvarn_paged_commit_exact), else -1 (from the page)
        self.confirmed = []          # provisional blocks whose tokens are now all accepted
        self.free_after = []         # slots released after the last layer
        self.mark_committed = []     # blocks whose tile is a record after the step
        self.mark_provisional = []   # blocks encoded from draft tokens (not committed)
        self.sink_copies = []        # (page, sink slot): copy the page's first r
                                     # rows into the slot before its commit
        self.finished = False        # Staging.finish has run (once per step)
        self.handoffs = []           # (scratch page, slot): after each layer's
                                     # attention the page is copied into the slot
                                     # (a tile started this step taking over the
                                     # slot of the tile it completed: _hand_over)


class Staging:
    def __init__(self, n_slots: int, tile: int, sink_tiles: int, n_blocks: int,
                 n_scratch: int = 0, sink_partial: int = 0, n_sink_slots: int = 0):
        self.n_scratch = n_scratch   # per-step scratch tiles: pages n_slots + k
        self.G = tile
        self.sink_tiles = sink_tiles
        self.n_slots = n_slots
        self.slot_of = np.full(n_blocks, -1, dtype=np.int64)
        self.block_of = np.full(n_slots, -1, dtype=np.int64)
        self.is_sink = np.zeros(n_slots, dtype=bool)
        self.committed = np.zeros(n_blocks, dtype=bool)
        # encoded into its block from tokens not yet accepted (speculative
        # drafts): the fp16 slot stays the tile's copy until a step starts
        # with every token of the tile accepted
        self.provisional = np.zeros(n_blocks, dtype=bool)
        # speculative bookkeeping, counted for tests and logs: tiles encoded
        # from drafts, provisional tiles written again (a draft in them was
        # rejected), provisional tiles committed once accepted
        self.stats = {"provisional": 0, "refilled": 0, "confirmed": 0}
        self.free = list(range(n_slots - 1, -1, -1))
        # sink shorter than a tile: the first r tokens of tile sink_tiles,
        # kept in fp16 slots keyed by that tile's block once it is a record
        self.sink_partial = sink_partial
        self.n_sink_slots = n_sink_slots
        self.sslot_of = np.full(n_blocks, -1, dtype=np.int64)
        self.sblock_of = np.full(n_sink_slots, -1, dtype=np.int64)
        self.sfree = list(range(n_sink_slots - 1, -1, -1))
        self.live_blocks = None      # callable -> set of block ids still in use

    # -- vLLM hands blocks out again: forget what they held ------------------
    def reset_blocks(self, block_ids) -> None:
        for b in block_ids:
            self._forget(b, committed=False)

    def _forget(self, b: int, committed: bool) -> None:
        """Release block b's staging slot and sink slot (if any); mark it
        committed or not, not provisional."""
        s = self.slot_of[b]
        if s >= 0:
            self._release(int(s))
        s = self.sslot_of[b]
        if s >= 0:
            self._release_sink(int(s))
        self.committed[b] = committed
        self.provisional[b] = False

    def adopt_loaded(self, block_ids) -> None:
        """Blocks whose pages a KV connector has just filled with records
        (kvarn_vllm.offload: a prefix loaded from the file tier), as kernel
        block ids (ints < n_blocks). Each becomes a committed tile with no
        staging slot:
          - vLLM does not report a block a connector loads for zeroing
            (scheduler.py:1264 skip_zeroing_group_ids, from
            kv_cache_coordinator.py:308), so reset_blocks never runs for it
            and it would keep its previous user's slot (slot_of, sslot_of)
            and committed flag: a stale slot is read as the tile's tokens;
          - committed, so that plan() reads the tile from its record when
            vLLM recomputes a prompt's last token inside it (a whole-prompt
            hit) instead of staging it as a fresh tile and committing a
            record from a mostly empty page.
        A sink tile's staged copy is put back by the caller afterwards
        (state.apply_loaded, which takes a slot with take_sink_slot)."""
        for b in block_ids:
            b = int(b)
            if not 0 <= b < len(self.committed):
                raise _lib.KvarnError(f"kvarn: loaded block {b} is not a block of this cache "
                                      f"({len(self.committed)} blocks)")
            self._forget(b, committed=True)

    def take_sink_slot(self, block: int) -> int:
        """A slot for the staged copy of loaded sink tile `block` (its
        record is in the block already: adopt_loaded); the caller fills
        the slot's pages. KvarnError when the pool is exhausted."""
        return self._take(int(block), True, set())

    def _release(self, s: int) -> None:
        b = self.block_of[s]
        if b >= 0:
            self.slot_of[b] = -1
        self.block_of[s] = -1
        self.is_sink[s] = False
        self.free.append(s)

    def _hand_over(self, s: int, block: int) -> None:
        """Slot s, whose tile commits this step, becomes block's: the
        sequence's new partial tile, staged in a scratch page this step and
        copied into s once each layer's attention has read the old tile."""
        old = self.block_of[s]
        if old >= 0:
            self.slot_of[old] = -1
        self.block_of[s] = block
        self.slot_of[block] = s
        self.is_sink[s] = False

    def _release_sink(self, s: int) -> None:
        self.sslot_of[self.sblock_of[s]] = -1
        self.sblock_of[s] = -1
        self.sfree.append(s)

    def _take_sink(self, block: int, protect) -> int:
        if not self.sfree:
            self._reclaim(protect)
        if not self.sfree:
            raise _lib.KvarnError(
                f"kvarn: the {self.n_sink_slots} sink slots are exhausted; they are "
                "sized for max_num_seqs sequences and the blocks of the KV budget")
        s = self.sfree.pop()
        self.sslot_of[block] = s
        self.sblock_of[s] = block
        return s

    def _sink_of(self, block: int, protect) -> int:
        """The block's sink slot: the one it has (a tile filled again after
        a rejection) or a new one."""
        s = int(self.sslot_of[block])
        return s if s >= 0 else self._take_sink(block, protect)

    def _take(self, block: int, sink: bool, protect) -> int:
        if not self.free:
            self._reclaim(protect)
        if not self.free:
            raise _lib.KvarnError(
                f"kvarn: the staging pool ({self.n_slots} tiles) is exhausted; "
                "it is sized for max_num_seqs sequences and the blocks of the KV "
                "budget: this cannot happen unless more sequences run than max_num_seqs")
        s = self.free.pop()
        self.slot_of[block] = s
        self.block_of[s] = block
        self.is_sink[s] = sink
        return s

    def _reclaim(self, protect) -> None:
        """Free the slots of blocks no running request holds: tails of
        finished requests, and sink copies kept only by the prefix cache
        (their records serve from then on)."""
        live = set(protect)
        if self.live_blocks is not None:
            live |= self.live_blocks()
        for s in range(self.n_slots):
            b = self.block_of[s]
            if b >= 0 and int(b) not in live:
                self._release(s)
        for s in range(self.n_sink_slots):
            b = self.sblock_of[s]
            if b >= 0 and int(b) not in live:
                self._release_sink(s)

    # -- one step ------------------------------------------------------------
    def _confirm(self, query_start_loc, seq_lens, block_table, p: StepPlan) -> None:
        """Provisional tiles whose tokens are all accepted now (the step
        starts at or past the tile's end) become committed: their record,
        encoded when the tile last filled, is final, and a non-sink tile's
        slot goes back to the pool."""
        G = self.G
        for i in range(len(seq_lens)):
            L0 = int(seq_lens[i]) - int(query_start_loc[i + 1] - query_start_loc[i])
            n_full = max(0, L0) // G
            if n_full == 0:
                continue
            blocks = block_table[i, :n_full]
            for t in np.nonzero(self.provisional[blocks])[0]:
                b = int(blocks[t])
                self.provisional[b] = False
                self.committed[b] = True
                self.stats["confirmed"] += 1
                p.confirmed.append(b)
                s = int(self.slot_of[b])
                if s >= 0 and not self.is_sink[s]:
                    self._release(s)

    def plan(self, query_start_loc: np.ndarray, seq_lens: np.ndarray,
             block_table: np.ndarray, n_tokens: int, n_draft=None) -> StepPlan:
        """n_draft: int [n_seqs], the speculative (not yet accepted) tokens
        at the end of each sequence's queries this step (None: none). A tile
        filled with any of them is encoded into its block for this step's
        later queries but not committed (provisional): it keeps its fp16
        slot, a rejection rewrites its slots, and it is encoded again when it
        fills again; it commits once a step starts with all its tokens
        accepted (_confirm)."""
        G, S = self.G, self.sink_tiles
        n_seqs = len(seq_lens)
        p = StepPlan()
        p.store_slots = np.full(n_tokens, -1, dtype=np.int64)
        max_tiles = max(1, int(block_table.shape[1]))
        p.tables = np.zeros((n_seqs, max_tiles), dtype=np.int32)
        p.has_sink = np.ones(n_seqs, dtype=bool)
        p.sink_slot = np.full(n_seqs, -1, dtype=np.int32)
        r = self.sink_partial
        self._confirm(query_start_loc, seq_lens, block_table, p)
        protect = set()
        for i in range(n_seqs):
            n = int(seq_lens[i])
            protect.update(int(b) for b in block_table[i, :(n + G - 1) // G])
        for i in range(n_seqs):
            q0, q1 = int(query_start_loc[i]), int(query_start_loc[i + 1])
            L = int(seq_lens[i])
            L0 = L - (q1 - q0)
            # positions from `known` on are drafts: a tile reaching them is
            # not committed this step
            known = L - (0 if n_draft is None else int(n_draft[i]))
            row = block_table[i]
            # slots of this sequence's tiles that commit this step: a later
            # tile of the chunk that needs a slot takes one over (a prompt
            # resumed mid-tile completes that tile and starts another; with
            # a slot of its own it would hold sink + 2 for the step, and
            # max_num_seqs x (sink + 1) slots would not serve it)
            handoff = []
            # the chunk's tokens, tile by tile
            pos = L0
            while pos < L:
                t = pos // G
                end = min(L, (t + 1) * G)
                b = int(row[t])
                j0, j1 = q0 + (pos - L0), q0 + (end - L0)
                offs = np.arange(pos - t * G, end - t * G, dtype=np.int64)
                if self.committed[b]:
                    # a record already (vLLM recomputing a token of a cached
                    # block): not stored again, read from the record
                    s = int(self.slot_of[b])
                    p.groups.append((i, t, j0, j1, pos - t * G,
                                     "pool" if s >= 0 else "record", s if s >= 0 else b))
                elif end == (t + 1) * G and end <= known and t >= S and self.slot_of[b] < 0:
                    # a whole non-sink tile within this chunk: scratch, commit
                    k = self.n_slots + p.n_scratch
                    p.n_scratch += 1
                    if p.n_scratch > self.n_scratch:
                        raise _lib.KvarnError(
                            f"kvarn: a step has more whole tiles than the {self.n_scratch} "
                            "scratch tiles sized from max_num_batched_tokens")
                    p.store_slots[j0:j1] = k * G + offs
                    if r > 0 and t == S:
                        p.sink_copies.append((k, self._sink_of(b, protect)))
                    p.commit_pool.append((k, b))
                    p.commit_rows.append(j0 if pos == t * G else -1)
                    p.mark_committed.append(b)
                    p.groups.append((i, t, j0, j1, pos - t * G, "scratch", k))
                else:
                    s = int(self.slot_of[b])
                    page, where = s, "pool"
                    if s < 0 and handoff and t >= S and p.n_scratch < self.n_scratch:
                        # staged in scratch for this step, then in the slot
                        # of the tile this chunk completed
                        s = handoff.pop()
                        p.free_after.remove(s)
                        self._hand_over(s, b)
                        page, where = self.n_slots + p.n_scratch, "scratch"
                        p.n_scratch += 1
                        p.handoffs.append((page, s))
                    elif s < 0:
                        s = page = self._take(b, t < S, protect)
                    if self.provisional[b]:
                        self.stats["refilled"] += 1
                    p.store_slots[j0:j1] = page * G + offs
                    if end == (t + 1) * G:
                        if r > 0 and t == S:
                            p.sink_copies.append((page, self._sink_of(b, protect)))
                        p.commit_pool.append((page, b))
                        # every token of the tile in this chunk, none a
                        # draft: a prefill chunk's whole (sink) tile
                        p.commit_rows.append(j0 if pos == t * G and end <= known else -1)
                        if end <= known:
                            p.mark_committed.append(b)
                            if t >= S:
                                p.free_after.append(s)
                                handoff.append(s)
                        else:
                            p.mark_provisional.append(b)
                    p.groups.append((i, t, j0, j1, pos - t * G, where, page))
                pos = end
            # full tiles below the last one touched: records, sink tiles in
            # their fp16 slot while it is there
            for t in range(max(0, (L - 1) // G)):
                b = int(row[t])
                s = int(self.slot_of[b])
                if t < S:
                    if s >= 0:
                        p.tables[i, t] = s
                    else:
                        p.has_sink[i] = False
                        p.tables[i, t] = b
                else:
                    p.tables[i, t] = b
            if r > 0 and L >= (S + 1) * G:
                # tile S is full, so a record by the end of this step: its
                # first r tokens come from the sink slot while the slot is
                # there
                ss = int(self.sslot_of[int(row[S])])
                if ss >= 0:
                    p.sink_slot[i] = ss
                else:
                    p.has_sink[i] = False
            if not p.has_sink[i]:
                # no fp16 sink left for this sequence: every full tile,
                # sink tiles included, is read from its record
                for t in range(min(S, max(0, (L - 1) // G))):
                    p.tables[i, t] = int(row[t])
        self._group_views(p)
        return p

    def _group_views(self, p: StepPlan) -> None:
        """One attention entry per group: its sequence's table with tile t
        pointing at the tile's fp16 page (or its record), seq_len up to the
        group's last query, causal; tiles [sink, t) are records."""
        G = self.G
        ng = len(p.groups)
        width = p.tables.shape[1]
        p.g_tables = np.zeros((max(ng, 1), width), dtype=np.int32)
        p.g_len = np.zeros(ng, dtype=np.int32)
        p.g_committed = np.zeros(ng, dtype=np.int32)
        p.g_sink = np.ones(ng, dtype=bool)
        p.g_sink_slot = np.full(ng, -1, dtype=np.int32)
        p.g_qsl = np.zeros(ng + 1, dtype=np.int32)
        for j, (i, t, j0, j1, off0, where, page) in enumerate(p.groups):
            p.g_tables[j, :t] = p.tables[i, :t]
            p.g_tables[j, t] = page
            p.g_len[j] = t * G + off0 + (j1 - j0)
            p.g_committed[j] = t + 1 if where == "record" else t
            p.g_sink[j] = p.has_sink[i]
            p.g_sink_slot[j] = p.sink_slot[i] if t > self.sink_tiles or where == "record" \
                else -1
            p.g_qsl[j + 1] = j1
        p.g_qsl[0] = p.groups[0][2] if ng else 0
        # the (group, column) entries of g_tables that name scratch pages
        # (the backend moves them to the layer's view of the shared scratch)
        sc = [(j, g[1]) for j, g in enumerate(p.groups) if g[5] == "scratch"]
        p.g_scratch = (np.array([j for j, _ in sc], dtype=np.int64),
                       np.array([t for _, t in sc], dtype=np.int64))

    def finish(self, p: StepPlan) -> None:
        for b in p.mark_committed:
            self.committed[b] = True
            self.provisional[b] = False
        for b in p.mark_provisional:
            self.provisional[b] = True
        self.stats["provisional"] += len(p.mark_provisional)
        for s in p.free_after:
            self._release(s)
