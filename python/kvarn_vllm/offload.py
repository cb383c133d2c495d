"""A file tier for vLLM 0.32's OffloadingConnector: prefixes offloaded to
files under a root directory and shared between vLLM processes (a
directory on /dev/shm is a CPU-memory tier; one on disk survives restarts).

    LLM(..., kv_transfer_config={
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "KvarnFileSpec",
                                      "spec_module_path": "kvarn_vllm.offload",
                                      "root": "/dev/shm/kvarn-kv"}})

(The API server, python -m vllm.entrypoints.openai.api_server: --kv-transfer-config
with the same JSON; not tested here.) The connector
(vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py:53)
builds the spec by name (vllm/v1/kv_offload/factory.py:30); the spec's
manager runs in the scheduler and names the files, its worker runs in the
model runner's process and copies pages.

What is stored: one file per offloaded vLLM block, ROOT/NS/<key>.blk, key =
vLLM's OffloadKey (the block's prefix hash, sha256 with a fixed seed, so
equal in every process, plus its group index) in hex. The file holds the
block's page of every layer back to back, in the connector's layer order,
exactly the bytes vLLM's cache tensor holds: for a kvarn cache dtype the
records (a KVarN tile [Hk, 128 tokens] of record bytes, or per-token
records), for vLLM's own dtypes its pages. For a KVarN format, a block of
the first KVARN_SINK_TILES tiles of a prompt also gets ROOT/NS/<key>.sink:
the sink tile's staged copy (the staging pool's page of each layer), which
the engine reads instead of the sink's record; it is written before the
block file, and each file is written to a temporary name and renamed, so a
reader sees a whole block (and its sink) or none.

NS, the namespace directory, names everything that must match for the
bytes to be reused (namespace()): layout version, model, cache dtype, bytes
per block, tokens per block, TP/PP world and rank, and for kvarn dtypes the
staging, sink, prefill-commit and sliding-window settings.

kv_role: kv_both loads and stores, kv_producer only stores, kv_consumer
only loads (KvarnFileManager). A request whose kv_transfer_params carry
PD_KEY waits for its blocks (pd_wait_s): prefill/decode disaggregation
with kvarn_vllm.pd_proxy in front of a producer and a consumer.

Eviction: with extra_config "max_bytes", each engine keeps its namespace
directory under that size by removing the least recently used blocks
nobody pins (KvarnFileManager); a block found by a lookup is pinned (hard
links) until it is loaded or its request ends, so eviction by any process
cannot take it between the two. Without max_bytes the directory grows
until removed.

Not done: a store is written at the engine step after the one that
computed its block (offloading/worker.py:236 defers it), so with LLM(...)
the last blocks of the last request before generate returns are stored
only if it generates again. Refused at spec creation (check_config): MLA, pipeline or tensor
parallelism, speculative decoding, KVARN_SINK_TOKENS, several KV-cache
groups (hybrid models): untested here.
"""
import hashlib
import itertools
import os
import re
import time

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec, LookupResult, OffloadingManager,
    OffloadingSpec, OffloadingWorker, PrepareStoreOutput, RequestOffloadingContext,
    TransferResult)

log = init_logger("vllm.kvarn_vllm.offload")

PD_KEY = "kvarn_pd"   # kv_transfer_params key of a prefill/decode hand-over (pd_wait_s)
ROLE_KEY = "kvarn_kv_role"   # the engine's kv_role, put in the extra config by platform.py
LAYOUT_VERSION = 1   # of the files' layout (module docstring); part of the namespace
SPEC_NAME = "KvarnFileSpec"


def _settings(vllm_config):
    """The kvarn Settings of the engine (recorded in additional_config by
    the platform, settings.py) or of the environment."""
    from .settings import Settings
    return Settings.of(vllm_config) if vllm_config is not None else Settings.from_env()


def check_config(vllm_config=None, offloading_config=None) -> None:
    """Raise ValueError naming what this file tier refuses (untested with
    it): MLA, pipeline parallelism, tensor parallelism, speculative
    decoding, KVARN_SINK_TOKENS (a partial sink's staged slots, Staging.
    sslot_of, are not stored), several KV-cache groups. vllm_config: the
    engine's VllmConfig where the caller has it (platform.py
    check_and_update_config, before an engine starts); offloading_config:
    the connector's OffloadingConfig (vllm/v1/kv_offload/config.py), what
    the spec itself gets. Either may be None."""
    bad = []
    if vllm_config is not None:
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        if mc is not None and getattr(mc, "use_mla", False):
            bad.append("MLA models (use_mla)")
        if pc.pipeline_parallel_size > 1:
            bad.append(f"pipeline parallelism (pipeline_parallel_size "
                       f"{pc.pipeline_parallel_size})")
        if pc.tensor_parallel_size > 1:
            bad.append(f"tensor parallelism (tensor_parallel_size {pc.tensor_parallel_size})")
        if getattr(vllm_config, "speculative_config", None) is not None:
            bad.append("speculative decoding (speculative_config)")
    if offloading_config is not None:
        p = offloading_config.parallel
        if p.pp_size > 1 and not any("pipeline" in b for b in bad):
            bad.append(f"pipeline parallelism (pipeline_parallel_size {p.pp_size})")
        if p.world_size > 1 and not any("parallel" in b for b in bad):
            bad.append(f"more than one worker (world size {p.world_size})")
        if len(offloading_config.groups) != 1:
            bad.append(f"{len(offloading_config.groups)} KV-cache groups (hybrid models)")
    dtype = (vllm_config.cache_config.cache_dtype if vllm_config is not None
             else offloading_config.model.dtype if offloading_config is not None else "")
    st = _settings(vllm_config)
    if str(dtype).startswith("kvarn_") and st.sink_tokens >= 0:
        bad.append(f"KVARN_SINK_TOKENS={st.sink_tokens} (a partial sink's staged tokens are "
                   "not stored; use KVARN_SINK_TILES)")
    if bad:
        raise ValueError(f"kvarn: the {SPEC_NAME} file tier does not serve (untested): "
                         + "; ".join(bad))


def namespace(offloading_config, vllm_config=None) -> str:
    """The directory name under root for this engine's files: everything
    that must match for another engine to reuse them, joined with '_'
    (model basename plus a hash of its full name, so two paths with the
    same basename differ). offloading_config: vllm/v1/kv_offload/config.py
    OffloadingConfig (model.dtype is the cache dtype, e.g.
    "kvarn_k4v2_g128", or the model's dtype for "auto"). For kvarn dtypes
    the staging, sink, prefill-commit and sliding-window settings of the
    engine (settings.py) are included."""
    c = offloading_config
    name = c.model.name.rstrip("/")
    parts = [f"v{LAYOUT_VERSION}",
             os.path.basename(name) + "-" + hashlib.sha256(name.encode()).hexdigest()[:8],
             c.model.dtype, f"{c.worker_kv_bytes_per_block}B",
             "t" + "-".join(str(g.tokens_per_block) for g in c.groups),
             f"tp{c.parallel.tp_size}pp{c.parallel.pp_size}r{c.parallel.rank}"]
    if c.model.dtype.startswith("kvarn_"):
        parts += settings_fields(vllm_config)
    return "_".join(p.replace("/", "-") for p in parts)


def settings_fields(vllm_config=None) -> list:
    """The kvarn settings (settings.py) that decide what a stored block
    means, as name fields: staging, sink tiles, prefill commit, sliding
    window (namespace; lmcache_mp.cache_name)."""
    from .settings import STAGING_DEFAULT
    st = _settings(vllm_config)
    from vllm.platforms import current_platform
    dev = "cuda" if current_platform.device_type == "cuda" else "cpu"
    return [f"st-{st.staging or STAGING_DEFAULT[dev]}", f"sink{st.sink_tiles}",
            f"commit-{st.prefill_commit or ('staged' if dev == 'cuda' else 'exact')}",
            f"sw-{st.sliding_window}"]


class KvarnFileLoadStoreSpec(LoadStoreSpec):
    """The file side of one transfer (vllm/v1/kv_offload/base.py:152): one
    (block file, sink file or None) pair per block, in the order of the
    GPU side's block ids."""

    def __init__(self, files):
        self.files = list(files)

    def __repr__(self):
        return f"KvarnFileLoadStoreSpec({len(self.files)} blocks)"


def _alive(pid: int) -> bool:
    """Whether process pid exists (signal 0; a process of another user
    counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pd_wait_s(params) -> "float | None":
    """The seconds a request of a prefill/decode hand-over waits for its
    blocks (docs/vllm-connectors.md "Prefill/decode"): params is the
    request's kv_transfer_params; PD_KEY in it is {"wait_s": seconds}, set
    by kvarn_vllm.pd_proxy on the request it sends to the decode instance.
    None where the request has no PD_KEY. Raises ValueError naming what is
    wrong where it is malformed (not a dict, wait_s not a finite number in
    [0, 3600])."""
    if not params or PD_KEY not in params:
        return None
    v = params[PD_KEY]
    w = v.get("wait_s") if isinstance(v, dict) else None
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= 3600:
        raise ValueError(f"kv_transfer_params[{PD_KEY!r}] must be {{\"wait_s\": seconds in "
                         f"[0, 3600]}}, not {v!r}")
    return float(w)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(v) -> int:
    """A size for extra_config "max_bytes": an int (bytes) or a string
    such as "512MiB", "2GiB", "1.5GB" (units B, KB/MB/GB/TB powers of 10,
    KiB/MiB/GiB/TiB powers of 2, case ignored). Raises ValueError naming
    the value where it is not a positive size."""
    if isinstance(v, bool):
        raise ValueError(f"kvarn: {SPEC_NAME} max_bytes {v!r} is not a size")
    if isinstance(v, int):
        n = v
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(v))
        if not m or m.group(2).upper() not in _UNITS:
            raise ValueError(f"kvarn: {SPEC_NAME} max_bytes {v!r} is not a size (bytes, or "
                             "e.g. '512MiB', '2GiB')")
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n < 1:
        raise ValueError(f"kvarn: {SPEC_NAME} max_bytes {v!r} must be at least 1 byte")
    return n


class KvarnFileManager(OffloadingManager):
    """The scheduler's side (vllm/v1/kv_offload/base.py:235): a block is
    offloaded when its file exists; keys whose file exists are not stored
    again.

    Pins: a lookup that finds a block pins its files (block and sink copy)
    by hard links in a directory of this process (ROOT/NS/pins/<pid>), so
    a file evicted or replaced by any process between the lookup and the
    load still loads whole; complete_load releases a loaded block's pins,
    on_request_finished the rest of the request's. A new manager removes
    the pins of processes that are gone.

    Eviction (max_bytes, None for none): before a store, where the files
    of the directory and the blocks to store (block_bytes each) would pass
    max_bytes, the least recently used blocks (oldest mtime; a hit sets it)
    that nobody pins (link count 1) are removed with their sink copies, and
    reported to vLLM as evicted; where that is not enough, fewer blocks are
    stored. Sink copies being stored are not counted ahead, so the
    directory can pass max_bytes by them until the next store.

    role: the engine's kv_role. "kv_both" loads and stores;
    "kv_producer" (a prefill instance) stores and never loads;
    "kv_consumer" (a decode instance) loads and never stores. A request
    whose kv_transfer_params carry PD_KEY (pd_wait_s) waits for its
    blocks: a block not there yet is looked up again at the next engine
    step (LookupResult.RETRY) until its file appears or wait_s has passed
    since the request arrived; then the rest is computed here (a warning
    names the request)."""

    def __init__(self, directory: str, role: str = "kv_both", max_bytes=None,
                 block_bytes: int = 0):
        if role not in ("kv_both", "kv_producer", "kv_consumer"):
            raise ValueError(f"kvarn: unknown kv_role {role!r} (kv_both, kv_producer, "
                             "kv_consumer)")
        self.dir = directory
        self.role = role
        self.max_bytes = None if max_bytes is None else parse_bytes(max_bytes)
        self.block_bytes = int(block_bytes)
        self._deadline: dict = {}      # request id -> time.monotonic() to stop waiting
        pins = os.path.join(directory, "pins")
        self.pin_dir = os.path.join(pins, str(os.getpid()))
        os.makedirs(pins, exist_ok=True)
        # pins left by processes gone (a crash) or by an earlier process of
        # this pid: removed (their links only; the blocks stay)
        for name in os.listdir(pins):
            d = os.path.join(pins, name)
            if name == str(os.getpid()) or (name.isdigit() and not _alive(int(name))):
                for f in os.listdir(d):
                    try:
                        os.unlink(os.path.join(d, f))
                    except FileNotFoundError:
                        pass
                if d != self.pin_dir:
                    try:
                        os.rmdir(d)
                    except OSError:
                        pass
        os.makedirs(self.pin_dir, exist_ok=True)
        self._looked: dict = {}        # request id -> {key: (block pin, sink pin or None)}
        self._pins: dict = {}          # key -> [pins of one prepare_load, ...]
        self._n = itertools.count()
        self.stats = {"hit": 0, "miss": 0, "loaded": 0, "stored": 0, "retry": 0,
                      "gave_up": 0, "evicted": 0, "not_stored": 0}

    def block_path(self, key) -> str:
        return os.path.join(self.dir, bytes(key).hex() + ".blk")

    def _pin(self, key):
        """(block pin, sink pin or None): hard links of key's files in
        pin_dir, the block's mtime set to now (a use, for eviction); None
        where the block file is gone."""
        src = self.block_path(key)
        n = next(self._n)
        blk = os.path.join(self.pin_dir, f"{n}.blk")
        try:
            os.link(src, blk)
        except FileNotFoundError:
            return None
        try:
            os.utime(blk)      # the pin is the block's inode: its mtime
        except OSError:
            pass
        sink = os.path.join(self.pin_dir, f"{n}.sink")
        try:
            os.link(src[:-4] + ".sink", sink)
        except FileNotFoundError:
            sink = None
        return blk, sink

    @staticmethod
    def _unpin(pinned) -> None:
        for p in pinned:
            if p is None:
                continue
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def lookup(self, key, req_context) -> LookupResult:
        if self.role == "kv_producer":
            return LookupResult.MISS
        rid = getattr(req_context, "req_id", None)
        looked = self._looked.setdefault(rid, {})
        k = bytes(key)
        if k not in looked:
            pinned = self._pin(k)
            if pinned is not None:
                looked[k] = pinned
        if k in looked:
            self.stats["hit"] += 1
            return LookupResult.HIT
        deadline = self._deadline.get(rid)
        if deadline is not None:
            if time.monotonic() < deadline:
                self.stats["retry"] += 1
                return LookupResult.RETRY
            del self._deadline[rid]
            self.stats["gave_up"] += 1
            log.warning("kvarn: request %s: a block of its prefill was not stored within "
                        "its wait (kv_transfer_params %s); computing the rest here", rid,
                        PD_KEY)
        self.stats["miss"] += 1
        return LookupResult.MISS

    def prepare_load(self, keys, req_context) -> KvarnFileLoadStoreSpec:
        rid = getattr(req_context, "req_id", None)
        looked = self._looked.get(rid, {})
        files = []
        for key in keys:
            k = bytes(key)
            pinned = looked.pop(k, None) or self._pin(k)
            if pinned is None:      # not looked up by this request, and gone
                raise FileNotFoundError(f"kvarn: block file {self.block_path(k)} is gone")
            self._pins.setdefault(k, []).append(pinned)
            files.append(pinned)
        self.stats["loaded"] += len(files)
        return KvarnFileLoadStoreSpec(files)

    def complete_load(self, keys, req_context) -> None:
        for key in keys:
            k = bytes(key)
            stack = self._pins.get(k)
            if not stack:
                continue
            self._unpin(stack.pop(0))
            if not stack:
                del self._pins[k]

    def _make_room(self, todo: list) -> tuple:
        """(the keys of todo that fit, the keys evicted): see the class
        comment. One scan of the directory."""
        blks, sinks, total = {}, {}, 0
        with os.scandir(self.dir) as it:
            for e in it:
                if not e.is_file(follow_symlinks=False):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                total += st.st_size
                if e.name.endswith(".blk"):
                    blks[e.name[:-4]] = st
                elif e.name.endswith(".sink"):
                    sinks[e.name[:-5]] = st
        need = len(todo) * self.block_bytes
        if total + need <= self.max_bytes:
            return todo, []
        storing = {bytes(k).hex() for k in todo}
        # unpinned blocks, oldest use first; a sink copy without its block
        # (a writer stopped between the two) goes first
        cands = [(st.st_mtime_ns, h) for h, st in blks.items()
                 if st.st_nlink == 1 and h not in storing]
        cands += [(-1, h) for h, st in sinks.items() if h not in blks and st.st_nlink == 1]
        evicted = []
        for _, h in sorted(cands):
            if total + need <= self.max_bytes:
                break
            for ext, table in ((".blk", blks), (".sink", sinks)):
                if h in table:
                    try:
                        os.unlink(os.path.join(self.dir, h + ext))
                        total -= table[h].st_size
                    except FileNotFoundError:
                        pass
            if h in blks:
                evicted.append(bytes.fromhex(h))
        keep = list(todo)
        while keep and total + len(keep) * self.block_bytes > self.max_bytes:
            keep.pop()
        self.stats["evicted"] += len(evicted)
        self.stats["not_stored"] += len(todo) - len(keep)
        return keep, evicted

    def prepare_store(self, keys, req_context) -> PrepareStoreOutput:
        todo = [] if self.role == "kv_consumer" else \
            [k for k in keys if not os.path.exists(self.block_path(k))]
        evicted = []
        if self.max_bytes is not None and todo:
            todo, evicted = self._make_room(todo)
        self.stats["stored"] += len(todo)
        return PrepareStoreOutput(
            keys_to_store=todo,
            store_spec=KvarnFileLoadStoreSpec(
                (self.block_path(k), self.block_path(k)[:-4] + ".sink") for k in todo),
            evicted_keys=evicted)

    def on_new_request(self, req_context) -> RequestOffloadingContext:
        rid = req_context.req_id
        try:
            w = pd_wait_s(req_context.kv_transfer_params)
        except ValueError as e:   # the scheduler must not raise: the request goes on unwaited
            log.warning("kvarn: request %s: %s; its blocks are not waited for", rid, e)
            w = None
        if w is not None and self.role != "kv_producer":
            self._deadline[rid] = time.monotonic() + w
        return RequestOffloadingContext()

    def on_request_finished(self, req_context) -> None:
        rid = getattr(req_context, "req_id", None)
        self._deadline.pop(rid, None)
        for pinned in self._looked.pop(rid, {}).values():
            self._unpin(pinned)

    def shutdown(self) -> None:
        for stack in self._pins.values():
            for pinned in stack:
                self._unpin(pinned)
        self._pins.clear()
        for looked in self._looked.values():
            for pinned in looked.values():
                self._unpin(pinned)
        self._looked.clear()
        try:
            os.rmdir(self.pin_dir)
        except OSError:
            pass


def _write(path: str, data: bytes) -> None:
    """data into path through a temporary name and os.replace (atomic on
    one file system: a reader sees the old file, none, or the whole new one)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class KvarnFileWorker(OffloadingWorker):
    """The model runner's side (vllm/v1/kv_offload/base.py:568),
    synchronous: submit_store / submit_load copy at once and report the job
    done at the next get_finished (a failed transfer would trip vLLM's
    assert in offloading/worker.py get_finished, so errors raise instead).

    kv_caches: the connector's CanonicalKVCaches (offloading/worker.py:71):
    per-layer int8 tensors [num_blocks, page bytes]; kvarn's pages
    ([nb, Hk, 128, rb/128] uint8 for KVarN, [nb, Hk, bs, rb] for per-token)
    are taken whole (canonical_mapping.py:334 _opaque_fallback_mapping).
    tile: the cache is a KVarN format (staging pool and sink tiles): loaded
    blocks are handed to state.queue_loaded, and sink tiles' staged copies
    are stored and loaded beside their blocks."""

    def __init__(self, kv_caches: CanonicalKVCaches, tile: bool):
        if len(kv_caches.group_data_refs) != 1:
            raise ValueError(f"kvarn: {SPEC_NAME} serves one KV-cache group, not "
                             f"{len(kv_caches.group_data_refs)}")
        self.tensors = [t.tensor for t in kv_caches.tensors]
        self.refs = kv_caches.group_data_refs[0]
        self.block_bytes = sum(r.page_size_bytes for r in self.refs)
        self.tile = tile
        self._done = []
        self.stats = {"stored_blocks": 0, "stored_bytes": 0, "sink_bytes": 0,
                      "loaded_blocks": 0}
        log.info("kvarn: file tier worker, %d layers, %d bytes per block%s", len(self.refs),
                 self.block_bytes, ", KVarN tiles (sinks stored)" if tile else "")

    def _block_bytes(self, b: int) -> bytes:
        return b"".join(self.tensors[r.tensor_idx][b, :r.page_size_bytes].contiguous()
                        .numpy().tobytes() for r in self.refs)

    def submit_store(self, job_id, src_spec: GPULoadStoreSpec, dst_spec) -> bool:
        """Write the pages of src_spec.block_ids (vLLM block ids, logically
        contiguous from block index src_spec.block_indices[0] of the
        request) to dst_spec's files: a sink tile's staged copy first (a
        block index < the staging's sink_tiles, state.sink_pages), then the
        block."""
        from .state import _State, sink_pages
        t0 = time.perf_counter()
        ids = [int(x) for x in src_spec.block_ids]
        if len(ids) != len(dst_spec.files):
            raise ValueError(f"kvarn: store of {len(ids)} blocks into "
                             f"{len(dst_spec.files)} files")
        first = int(src_spec.block_indices[0]) if len(src_spec.block_indices) else 0
        sink_tiles = _State.staging.sink_tiles if (self.tile and _State.staging) else 0
        n = 0
        for i, (b, (blk, sink)) in enumerate(zip(ids, dst_spec.files)):
            if first + i < sink_tiles:
                data = sink_pages(b)
                if data is not None:
                    _write(sink, data)
                    n += len(data)
                    self.stats["sink_bytes"] += len(data)
            data = self._block_bytes(b)
            _write(blk, data)
            n += len(data)
            self.stats["stored_bytes"] += len(data)
        self.stats["stored_blocks"] += len(ids)
        self._done.append(TransferResult(job_id, True, n, time.perf_counter() - t0))
        return True

    def submit_load(self, job_id, src_spec, dst_spec: GPULoadStoreSpec) -> bool:
        """Copy src_spec's block files into the pages of dst_spec.block_ids;
        for a KVarN cache, queue each block (and its sink copy) for the
        staging bookkeeping (state.queue_loaded). A file of the wrong size
        raises ValueError (the namespace is meant to make this impossible)."""
        import torch
        from .state import queue_loaded
        t0 = time.perf_counter()
        ids = [int(x) for x in dst_spec.block_ids]
        if len(ids) != len(src_spec.files):
            raise ValueError(f"kvarn: load of {len(src_spec.files)} files into "
                             f"{len(ids)} blocks")
        n = 0
        for b, (blk, sink) in zip(ids, src_spec.files):
            with open(blk, "rb") as f:
                data = f.read()
            if len(data) != self.block_bytes:
                raise ValueError(f"kvarn: {blk} has {len(data)} bytes, not the "
                                 f"{self.block_bytes} of a block of this cache")
            src = torch.frombuffer(bytearray(data), dtype=torch.int8)
            off = 0
            for r in self.refs:
                self.tensors[r.tensor_idx][b, :r.page_size_bytes].copy_(
                    src[off:off + r.page_size_bytes])
                off += r.page_size_bytes
            n += len(data)
            if self.tile:
                sk = None
                if sink is not None:
                    with open(sink, "rb") as f:
                        sk = f.read()
                    n += len(sk)
                queue_loaded(b, sk)
        self.stats["loaded_blocks"] += len(ids)
        self._done.append(TransferResult(job_id, True, n, time.perf_counter() - t0))
        return True

    def get_finished(self) -> list:
        out, self._done = self._done, []
        return out

    def wait(self, job_ids) -> None:
        return None    # synchronous: every submitted job is done


class KvarnFileSpec(OffloadingSpec):
    """The spec the connector builds (vllm/v1/kv_offload/base.py:595):
    extra_config "root" (required: the directory; created if missing),
    "max_bytes" (optional: the size the engine keeps its namespace
    directory under by evicting, parse_bytes; no eviction without it). The
    files of this engine go to root/namespace(config). Raises ValueError
    for a configuration check_config refuses, a missing root or a bad
    max_bytes."""

    def __init__(self, config):
        super().__init__(config)
        from vllm.config import get_current_vllm_config_or_none
        vc = get_current_vllm_config_or_none()
        check_config(vc, config)
        root = self.extra_config.get("root")
        if not root:
            raise ValueError(f"kvarn: {SPEC_NAME} needs kv_connector_extra_config['root'], "
                             "the directory of the file tier (e.g. /dev/shm/kvarn-kv)")
        self.dir = os.path.join(root, namespace(config, vc))
        ktc = getattr(vc, "kv_transfer_config", None) if vc is not None else None
        mb = self.extra_config.get("max_bytes")
        self.max_bytes = None if mb is None else parse_bytes(mb)
        self.role = (self.extra_config.get(ROLE_KEY) or getattr(ktc, "kv_role", None)
                     or "kv_both")
        os.makedirs(self.dir, exist_ok=True)
        dtype = config.model.dtype
        self.tile = False
        if dtype.startswith("kvarn_"):
            from . import _lib
            self.tile = bool(_lib.parse_format(dtype).per_tile)
        self._manager = None
        self._worker = None
        log.info("kvarn: %s file tier in %s (%d bytes per block, %s)", SPEC_NAME, self.dir,
                 config.worker_kv_bytes_per_block, self.role)

    def get_manager(self) -> KvarnFileManager:
        if self._manager is None:
            self._manager = KvarnFileManager(self.dir, self.role, self.max_bytes,
                                             self.config.worker_kv_bytes_per_block)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> KvarnFileWorker:
        if self._worker is None:
            self._worker = KvarnFileWorker(kv_caches, self.tile)
        return self._worker
