"""What kvarn_vllm.lmcache_mp's connector refuses, without importing
LMCache: platform.py calls check_config from vLLM's config hook, before the
worker starts, and importing lmcache there (numba, llvmlite) makes vLLM
0.32's CPU worker fail at init_worker (vllm/triton_utils/dispatcher.py
_rebind_kernels: "AttributeError: '_lib_fn_wrapper' object has no attribute
'get'", llvmlite.binding.ffi's lib object answering vars())."""
from . import _lib
from ._lib import is_kvarn_dtype


def _tile_format(vllm_config):
    """The parsed kvarn format when the cache dtype is a KVarN tile format
    (per_tile), else None."""
    dtype = vllm_config.cache_config.cache_dtype
    if not is_kvarn_dtype(dtype):
        return None
    fmt = _lib.parse_format(dtype)
    return fmt if fmt.per_tile else None


def check_config(vllm_config) -> None:
    """Raise ValueError for what this connector does not serve: a KVarN tile
    format with sink tiles (KVARN_SINK_TILES > 0, the default 1) or a partial
    sink (KVARN_SINK_TOKENS). Called by platform.py (before an engine starts)
    and by the connector's constructor."""
    dtype = vllm_config.cache_config.cache_dtype
    if not is_kvarn_dtype(dtype):
        return
    from .offload import _settings
    st = _settings(vllm_config)
    bad = []
    if st.sink_tokens >= 0:
        bad.append(f"KVARN_SINK_TOKENS={st.sink_tokens}")
    elif _tile_format(vllm_config) is not None and st.sink_tiles > 0:
        bad.append(f"KVARN_SINK_TILES={st.sink_tiles}")
    if bad:
        raise ValueError(
            f"kvarn: KvarnLMCacheMPConnector does not serve {', '.join(bad)} with {dtype}: a "
            "sink tile is attended from a staged copy kept outside vLLM's KV cache tensor "
            "(the plug-in's staging pool), which LMCache does not move (a loaded prefix would "
            "be attended from the sink's record instead, logprobs off a cold run's); set "
            "KVARN_SINK_TILES=0 (and leave KVARN_SINK_TOKENS unset), or use the file tier "
            "(kvarn_vllm.offload.KvarnFileSpec), which stores the sink copy")


def llvmlite_vars_fix() -> None:
    """LMCache imports numba, hence llvmlite, whose llvmlite.binding.ffi.lib
    (a __slots__ object whose __getattr__ wraps any name of its CDLL)
    answers `__dict__` with a function wrapper. vLLM 0.32's CPU worker scans
    every module's attributes at init_worker (vllm/triton_utils/
    dispatcher.py _rebind_kernels: `vars(value).get("kernel")`) and fails
    with "AttributeError: '_lib_fn_wrapper' object has no attribute 'get'"
    where LMCache was imported first (vLLM resolves the connector class
    while it builds the config, so an in-process engine,
    VLLM_ENABLE_V1_MULTIPROCESSING=0, with any LMCache connector always
    does). Its function table gets an empty `__dict__` entry, which
    llvmlite never looks up itself. Called by platform.py for any connector
    module path naming lmcache, and by lmcache_mp at import."""
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    tab = getattr(ffi.lib, "_fntab", None)
    if isinstance(tab, dict):
        tab.setdefault("__dict__", {})

