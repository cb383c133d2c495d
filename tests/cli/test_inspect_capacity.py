"""kvarn inspect's capacity table (issue 11) against the byte arithmetic of
the record layout (../shared/spec/KVARN.md) and the paged cache's documented
pools (docs/capacity.md "How capacity is computed"), computed here independently of the
library. The fill of a created cache to the printed count is
tests/cache/test_cache_capacity.c; this checks that the tool prints the
library's numbers for a real model shape. No model needed: the shape is
SmolLM2-135M's (30 layers, 3 KV heads, head_dim 64)."""
import re
import subprocess

from conftest import REPO

L, HK, D = 30, 3, 64
GIB = 1 << 30
# Bookkeeping (block tables, id pools, scratch) of these caches stays below
# this many bytes: 8 bytes per block or page and 12 per tile per sequence,
# under 20,000 blocks and 64 sequences of <= 1,700 tiles, plus a few tile
# scratch buffers of 128 x 64 floats: < 0.2 + 1.4 + 0.2 MB.
BOOKS_MAX = 2 << 20
# The fixed part of it (src/cache/capacity.c kvarn_cache_capacity_get): the
# cache struct, two tile buffers of 128 x 64 floats (64 KiB), and the
# encoder's workspace (a k8v8 record of ~17 KiB, two buffers of
# (128 x 64 + 128) floats, 32 x 128 floats: < 110 KiB): < 256 KiB.
BOOKS_FIXED = 256 << 10


def books_max(k, tiles, ids, per_tile=3):
    """A bound on the bookkeeping of a cache sized for k sequences of
    `tiles` tiles with `ids` blocks and pages: the fixed part, 8 bytes per
    id, per sequence its struct (< 128 bytes), per_tile int32 per tile
    (block table, block, page; + G / T with small tail pages) and one int
    per layer."""
    return BOOKS_FIXED + 8 * ids + k * (128 + 4 * per_tile * tiles + 4 * L)


def inspect(kvarn_bin, *args):
    r = subprocess.run([kvarn_bin, "inspect", "--layers", str(L), "--kv-heads", str(HK),
                        "--head-dim", str(D)] + list(args), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = {}
    lines = r.stdout.splitlines()
    first = [i for i, line in enumerate(lines) if line.startswith("format ")][0] + 1
    for line in lines[first:]:
        if line.startswith("tokens fit:"):
            break
        f = line.split()
        rows[f[0]] = f
    return rows, r.stdout


def one_value(lo, hi):
    """The count the bounds pin down; the budgets here are chosen so that
    the unknown bookkeeping bytes cannot move it."""
    assert lo == hi, (lo, hi)
    return lo


# fp16: 2 (K, V) x 64 channels x 2 bytes per token-head; blocks of 16 tokens.
FP16_TOKEN = L * HK * 2 * D * 2
# kvarn_k4v2_g128, D = 64: one (tile, head) record holds 128 x 64 4-bit K
# codes, 128 x 64 2-bit V codes and the scales: 7296 bytes (KVARN.md), i.e.
# 5130 bytes per token over all 90 token-heads.
K4V2_BLOCK = L * HK * 7296
# A staging page holds one 128-token tile of every layer and KV head. By
# default its tokens are int8 token records (docs/paged-cache.md "Staging
# below fp16"): per K or V vector D codes, an fp16 scale and an fp16
# zero-point, 2 (D + 4) bytes per token-head; fp16 staging holds the fp16
# K and V, 4 D bytes.
PAGE = L * HK * 128 * 2 * (D + 4)
PAGE_FP16 = L * HK * 2 * 128 * D * 2


def auto_pages(k):
    """Auto staging pages of a KVarN cache for k sequences, sink_tiles 1
    (docs/paged-cache.md): the sink and one tail page each, and one shared
    page per 8 sequences."""
    return 2 * k + -(-k // 8)


def kvarn_seqs(budget, blocks_per_seq, page=PAGE, books=False):
    """Most k whose auto pages and k x blocks_per_seq blocks fit budget
    (books: with books_max of such a cache counted too)."""
    def need(k):
        ids = auto_pages(k) + k * blocks_per_seq
        extra = books_max(k, blocks_per_seq + 1, ids) if books else 0
        return auto_pages(k) * page + k * blocks_per_seq * K4V2_BLOCK + extra
    k = 0
    while need(k + 1) <= budget:
        k += 1
    return k


def test_seqs_fit_fp16_and_kvarn(kvarn_bin):
    rows, out = inspect(kvarn_bin, "--budget", "1GiB", "--kv-cache-dtype", "fp16,kvarn_k4v2_g128")
    # fp16: a 2k request is 128 blocks of 16 tokens, nothing else.
    per = 2048 * FP16_TOKEN
    want = one_value((GIB - BOOKS_MAX) // per, GIB // per)
    assert int(rows["fp16"][7]) == want, out
    # kvarn_k4v2_g128: a 2k request is 16 tiles: the sink (a page) and 15
    # blocks; a cache for k sequences keeps auto_pages(k) pages.
    want2k = one_value(kvarn_seqs(GIB, 15, books=True), kvarn_seqs(GIB, 15))
    assert int(rows["kvarn_k4v2_g128"][7]) == want2k, out
    # 8k: 64 tiles, 1 sink page + 63 blocks
    want = one_value(kvarn_seqs(GIB, 63, books=True), kvarn_seqs(GIB, 63))
    assert int(rows["kvarn_k4v2_g128"][8]) == want, out
    # staged in fp16 (the spec's), each page 4D / (2D + 8) times larger
    rows, out = inspect(kvarn_bin, "--budget", "1GiB", "--kv-cache-dtype", "kvarn_k4v2_g128",
                        "--kvarn-staging", "fp16")
    want16 = one_value(kvarn_seqs(GIB, 15, PAGE_FP16, books=True),
                       kvarn_seqs(GIB, 15, PAGE_FP16))
    assert int(rows["kvarn_k4v2_g128"][7]) == want16 < want2k, out


def test_tokens_fit_counts_the_pages(kvarn_bin):
    # The case: 1 GiB, 64 sequences. The pages of 64 sequences
    # (auto_pages(64) = 136) are taken first; the blocks share the rest; every sequence
    # holds its sink tile and the first one all the blocks.
    # The bookkeeping (BOOKS_MAX) may cost the last block or two, so the
    # count lies between the two bounds; the old answer (209,280 tokens, the
    # pages not counted) lies far above them.
    for staging, page in (("int8", PAGE), ("fp16", PAGE_FP16)):
        rows, out = inspect(kvarn_bin, "--budget", "1GiB", "--kv-cache-dtype", "kvarn_k4v2_g128",
                            "--kvarn-staging", staging)
        rest = GIB - auto_pages(64) * page
        hi = rest // K4V2_BLOCK
        # the exact-record marks (one byte per tile and layer in each
        # sequence's table, sized for a sequence that holds every block and
        # its sink: at most hi + 1 tiles) come on top of BOOKS_MAX
        marks = 64 * L * (hi + 1)
        lo = (rest - BOOKS_MAX - marks) // K4V2_BLOCK
        tokens = int(rows["kvarn_k4v2_g128"][5])
        assert tokens % 128 == 0 and lo <= tokens // 128 - 64 <= hi, out
    # one sequence: auto_pages(1) = 3 pages
    rows, out = inspect(kvarn_bin, "--budget", "1GiB", "--max-seqs", "1",
                        "--kv-cache-dtype", "kvarn_k4v2_g128")
    rest = GIB - auto_pages(1) * PAGE
    lo, hi = (rest - BOOKS_MAX) // K4V2_BLOCK, rest // K4V2_BLOCK
    tokens = int(rows["kvarn_k4v2_g128"][5])
    assert tokens % 128 == 0 and lo <= tokens // 128 - 1 <= hi, out


def test_budget_below_the_pages_is_shown(kvarn_bin):
    # 200 MiB < auto_pages(64) = 136 pages (213 MB): a cache for 64 sequences cannot be
    # created, and the table says so instead of a token count.
    b = 200 << 20
    assert auto_pages(64) * PAGE > b
    rows, out = inspect(kvarn_bin, "--budget", "200MiB", "--kv-cache-dtype", "kvarn_k4v2_g128")
    assert rows["kvarn_k4v2_g128"][5] == "-", out
    assert "lower --max-seqs" in out
    # but requests of 2k still fit in a cache sized for them
    assert int(rows["kvarn_k4v2_g128"][7]) == one_value(kvarn_seqs(b, 15, books=True),
                                                        kvarn_seqs(b, 15)), out


def test_small_tail_pages_and_short_sink(kvarn_bin):
    # --sink-tokens 16 --tail-page-tokens 16 (docs/paged-cache.md "Small
    # tail pages"): no whole page (the sink is 16 tokens of tile 0, kept in
    # a slot of 16 tokens per sequence, tile 0 a block); the tail in pages
    # of 16 tokens, auto (k + ceil(k / 8)) x 128 / 16 of them for k
    # sequences, each an eighth of a whole page (int8 records, the
    # default staging). A 2k request is 16 blocks.
    small, slot = PAGE // 8, PAGE // 8

    def seqs(budget, books=False):
        def need(k):
            n_small = (k + -(-k // 8)) * 8
            extra = books_max(k, 16, n_small + k * 16, per_tile=3 + 8) if books else 0
            return n_small * small + k * slot + k * 16 * K4V2_BLOCK + extra
        k = 0
        while need(k + 1) <= budget:
            k += 1
        return k

    rows, out = inspect(kvarn_bin, "--budget", "1GiB", "--kv-cache-dtype", "kvarn_k4v2_g128",
                        "--sink-tokens", "16", "--tail-page-tokens", "16")
    assert "tail pages of 16 tokens" in out
    assert int(rows["kvarn_k4v2_g128"][7]) == one_value(seqs(GIB, books=True), seqs(GIB)), out
    # T = G is the whole-page cache: the default table's numbers
    base, _ = inspect(kvarn_bin, "--budget", "1GiB", "--kv-cache-dtype", "kvarn_k4v2_g128")
    same, _ = inspect(kvarn_bin, "--budget", "1GiB", "--kv-cache-dtype", "kvarn_k4v2_g128",
                      "--tail-page-tokens", "128")
    assert base["kvarn_k4v2_g128"][5:] == same["kvarn_k4v2_g128"][5:]


# ---- the headings (fresh-user trial: two columns headed "x fp16", told
# apart only by a second heading line, "(records)" and "(tokens)") ---------

HEADINGS = ["format", "G", "bytes/token", "cap x fp16", "tokens fit", "fit x fp16", "2k seqs",
            "8k seqs", "32k seqs"]


def table_lines(out):
    lines = out.splitlines()
    at = [i for i, line in enumerate(lines) if line.startswith("format ")]
    assert len(at) == 1, out
    end = [i for i, line in enumerate(lines) if line.startswith("tokens fit:")][0]
    return lines[at[0]], lines[at[0] + 1:end]


def test_headings_are_distinct_and_one_line(kvarn_bin):
    _, out = inspect(kvarn_bin, "--budget", "1GiB", "--kv-cache-dtype", "fp16,int8,kvarn_k4v2_g128")
    header, rows = table_lines(out)
    assert re.split(r"\s{2,}", header.strip()) == HEADINGS, header
    assert len(re.findall(r"(?<![a-z]) x fp16", header)) == 0, header  # no bare "x fp16"
    # the row after the headings is the first format's: no second heading line
    assert [r.split()[0] for r in rows] == ["fp16", "int8", "kvarn_k4v2_g128"], out
    # each ratio ends under the end of its heading
    for heading in ("cap x fp16", "fit x fp16"):
        end = header.index(heading) + len(heading)
        for row in rows:
            assert row[end - 1] == "x" and row[end] == " ", (heading, row)


def markdown(header, rows):
    """The table as README shows it: the command's columns, one cell each."""
    cells = [HEADINGS]
    for row in rows:
        f = row.split()
        cells.append([f[0], f[1], f[2] + " " + f[3]] + f[4:])
        assert len(cells[-1]) == len(HEADINGS), row
    md = ["| " + " | ".join(c) + " |" for c in cells]
    md.insert(1, "|" + "---|" * len(HEADINGS))
    return md


def test_readme_copy_is_the_output(kvarn_bin, model_path):
    # README "Capacity" shows this command's table; it must be what the
    # command prints (regenerated, not edited by hand)
    cmd = "build/kvarn inspect -m models/SmolLM2-135M-Instruct.Q4_1.gguf --budget 1GiB"
    readme = (REPO / "README.md").read_text().splitlines()
    at = readme.index("    " + cmd)
    table = []
    for line in readme[at + 1:]:
        if table and not line.startswith("|"):
            break
        if line.startswith("|"):
            table.append(line)
    r = subprocess.run([kvarn_bin, "inspect", "-m", model_path, "--budget", "1GiB"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert table == markdown(*table_lines(r.stdout)), (table, r.stdout)


def test_kvarn_settings_line_only_with_a_kvarn_format(kvarn_bin):
    """The "KVarN: sink tokens ..." line is about KVarN rows: absent when
    the list has none; the default tail reads "a whole tile", not
    "0 tokens"."""
    _, out = inspect(kvarn_bin, "--kv-cache-dtype", "int8,fp16", "--sink-tokens", "16")
    assert "KVarN:" not in out, out
    _, out = inspect(kvarn_bin, "--kv-cache-dtype", "int8,kvarn_k4v2_g128", "--sink-tokens", "16")
    assert "KVarN: sink tokens 16, tail pages of a whole tile\n" in out, out
    _, out = inspect(kvarn_bin, "--kv-cache-dtype", "kvarn_k4v2_g128", "--tail-page-tokens", "16")
    assert "KVarN: sink tokens default (one tile), tail pages of 16 tokens\n" in out, out
