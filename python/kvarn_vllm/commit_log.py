"""Testing only: the records of every tile that became final, logged after
each step (KVARN_TEST_COMMIT_LOG; the comment below)."""
import os

from .state import _State


# Testing only: KVARN_TEST_COMMIT_LOG=PATH appends, after each step once
# PATH.go exists (tests/vllm/run_llm.py makes it when the engine is up, so
# vLLM's warm-up runs on dummy inputs are left out), the records of every tile that
# became final (committed from accepted tokens, or a provisional tile
# confirmed): their bytes, layer by layer (this process's kvarn layers in
# the order they run), each layer's KV heads in order, to
# PATH.tp<T>.pp<P>.<pid>.bin and a line "record SHA-256 block offset bytes"
# to PATH.tp<T>.pp<P>.<pid> (T, P: the process's tensor- and
# pipeline-parallel ranks), then a line with the staging counters.
# tests/vllm/test_spec_decode.py compares the records of a speculative run
# with a plain one, test_parallel.py those of TP/PP runs with TP=1's.
def _commit_log_path() -> str:
    return os.environ.get("KVARN_TEST_COMMIT_LOG", "")


def _parallel_ranks() -> tuple:
    """(tensor-parallel rank, pipeline-parallel rank) of this process;
    (0, 0) where vLLM's groups are not set up."""
    try:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
    except (AssertionError, AttributeError, ImportError):
        return 0, 0


def _log_commits(p) -> None:
    import hashlib
    import json
    caches = [_State.kv_caches[n] for n in _State.layers]
    tp, pp = _parallel_ranks()
    base = f"{_commit_log_path()}.tp{tp}.pp{pp}.{os.getpid()}"
    with open(base, "a") as f, open(base + ".bin", "ab") as data:
        for b in list(p.mark_committed) + list(p.confirmed):
            raw = b"".join(c[b].cpu().numpy().tobytes() for c in caches)
            off = data.tell()
            data.write(raw)
            f.write(f"record {hashlib.sha256(raw).hexdigest()} {b} {off} {len(raw)}\n")
        f.write("stats " + json.dumps(_State.staging.stats) + "\n")
