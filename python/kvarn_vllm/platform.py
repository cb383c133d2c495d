"""The kvarn platform: vLLM's own platform class (CpuPlatform, ZenCpuPlatform
or CudaPlatform, whichever vLLM would pick on this machine) subclassed,
loaded through vLLM's public platform hook (entry point group
vllm.platform_plugins, platform_plugin below). For any cache dtype that is
not a kvarn name every method is vLLM's own. For a kvarn name:

  check_and_update_config   the front-end checks (checks.check_model: what
                            the kvarn backend refuses, before an engine
                            process starts), the settings read once and
                            recorded in the configuration (settings.py),
                            the worker class (worker.py: the staging pool
                            out of the KV budget, block resets) and the
                            scheduler class (scheduler.py: new blocks
                            always reported);
  get_attn_backend_cls      the kvarn backend (backend.py, or
                            mla_backend.py for MLA models);
  update_block_size_for_backend
                            sliding-window layers in vLLM's own cache:
                            pages aligned (layout.align_pages).

vLLM consults platform plug-ins only where VLLM_TARGET_DEVICE is not "cpu"
(an explicit CPU target skips them) and takes at most one out-of-tree
platform: with another one installed, or with VLLM_TARGET_DEVICE=cpu, the
kvarn platform is not active and a kvarn cache dtype is refused at
configuration with that reason (patches.py, the name check).
"""
import functools
import importlib

from ._lib import is_kvarn_dtype   # ctypes and os only: the library loads on first use

CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
GPU_WORKER = "vllm.v1.worker.gpu_worker.Worker"
BACKEND_PATH = "kvarn_vllm.backend.KvarnAttentionBackend"
MLA_BACKEND_PATH = "kvarn_vllm.mla_backend.KvarnMLABackend"

# vLLM's platform class path -> the name of its kvarn subclass here
_BASES = {
    "vllm.platforms.cpu.CpuPlatform": "KvarnCpuPlatform",
    "vllm.platforms.zen_cpu.ZenCpuPlatform": "KvarnZenCpuPlatform",
    "vllm.platforms.cuda.CudaPlatform": "KvarnCudaPlatform",
}


@functools.cache
def _builtin_choice():
    """The platform class path vLLM's built-in detection picks here among
    those kvarn serves (CPU, Zen CPU, CUDA), or None. Probed once a process
    (vLLM calls platform_plugin twice while it resolves its platform)."""
    from vllm.platforms import cpu_platform_plugin, cuda_platform_plugin
    for probe in (cuda_platform_plugin, cpu_platform_plugin):
        try:
            q = probe()
        except Exception:   # a probe that fails is vLLM's to report
            q = None
        if q in _BASES:
            return q
    return None


def _other_platform_plugins() -> list:
    from importlib.metadata import entry_points
    from vllm.plugins import PLATFORM_PLUGINS_GROUP
    return [ep.name for ep in entry_points(group=PLATFORM_PLUGINS_GROUP)
            if not ep.value.startswith("kvarn_vllm.")]


def platform_plugin():
    """Entry point (group vllm.platform_plugins): the kvarn subclass of the
    platform vLLM would pick, as a class path; None (vLLM's own platform)
    where that is one kvarn does not serve, or another out-of-tree platform
    plug-in is installed (vLLM activates at most one)."""
    if _other_platform_plugins():
        return None
    base = _builtin_choice()
    return None if base is None else f"{__name__}.{_BASES[base]}"


def is_active() -> bool:
    """Whether vLLM's current platform is a kvarn platform."""
    from vllm.platforms import current_platform
    return isinstance(current_platform, _KvarnPlatform)


def inactive_reason() -> str:
    """Why the kvarn platform is not vLLM's current platform, for errors."""
    import vllm.envs as envs
    if envs.VLLM_TARGET_DEVICE == "cpu":
        return ("VLLM_TARGET_DEVICE=cpu makes vLLM skip its platform plug-ins, the kvarn one "
                "among them: unset it (vLLM's CPU build finds the CPU by itself)")
    others = _other_platform_plugins()
    if others:
        return (f"another platform plug-in is installed ({', '.join(others)}) and vLLM "
                f"activates only one")
    from vllm.platforms import current_platform
    return (f"vLLM's platform here is {type(current_platform).__name__}, which the kvarn "
            f"plug-in does not serve (CPU and CUDA only)")


class _KvarnPlatform:
    """The kvarn methods, before vLLM's platform class in the MRO."""

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        super().check_and_update_config(vllm_config)
        cc = vllm_config.cache_config
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        extra = getattr(ktc, "kv_connector_extra_config", None) or {}
        if "lmcache" in str(getattr(ktc, "kv_connector_module_path", None) or "") or \
                "LMCache" in str(getattr(ktc, "kv_connector", None) or ""):
            # an LMCache connector (kvarn_vllm.lmcache_mp or LMCache's own)
            from .lmcache_config import llvmlite_vars_fix
            llvmlite_vars_fix()
        if extra.get("spec_module_path") == "kvarn_vllm.offload":
            # the file tier (offload.py): what it refuses, before an engine starts
            from .offload import ROLE_KEY, check_config
            check_config(vllm_config)
            # the spec is built from an OffloadingConfig without the engine's
            # kv_role (vllm/v1/kv_offload/factory.py create_spec): it rides here
            if isinstance(ktc.kv_connector_extra_config, dict):
                ktc.kv_connector_extra_config[ROLE_KEY] = ktc.kv_role or "kv_both"
        if cc is None or not is_kvarn_dtype(cc.cache_dtype):
            return
        from .checks import check_kv_connector, check_model
        from .settings import Settings
        settings = Settings.from_env()
        settings.record(vllm_config)
        check_model(vllm_config, settings)
        check_kv_connector(vllm_config)
        if getattr(ktc, "kv_connector_module_path", None) == "kvarn_vllm.lmcache_mp":
            # LMCache's MP server (lmcache_mp.py): what it refuses, before an engine starts
            from .lmcache_config import check_config as lmcache_check
            lmcache_check(vllm_config)
        pc, sc = vllm_config.parallel_config, vllm_config.scheduler_config
        own = GPU_WORKER if vllm_config.device_config.device_type == "cuda" else CPU_WORKER
        if pc.worker_cls in ("auto", own):
            pc.worker_cls = "kvarn_vllm.worker." + (
                "KvarnGPUWorker" if own == GPU_WORKER else "KvarnCPUWorker")
        elif not str(pc.worker_cls).startswith("kvarn_vllm."):
            raise ValueError(f"kvarn: a kvarn cache needs the kvarn worker class (worker.py); "
                             f"this configuration names its own: {pc.worker_cls}")
        if sc.scheduler_cls is None:
            sc.scheduler_cls = "kvarn_vllm.scheduler." + (
                "KvarnAsyncScheduler" if sc.async_scheduling else "KvarnScheduler")
        elif not str(sc.scheduler_cls).startswith("kvarn_vllm."):
            raise ValueError(f"kvarn: a kvarn cache needs the kvarn scheduler class "
                             f"(scheduler.py); this configuration names its own: "
                             f"{sc.scheduler_cls}")

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if is_kvarn_dtype(attn_selector_config.kv_cache_dtype):
            if attn_selector_config.use_mla:
                return MLA_BACKEND_PATH
            from .state import _State
            _State.dtype_name = attn_selector_config.kv_cache_dtype
            return BACKEND_PATH
        return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)

    @classmethod
    def update_block_size_for_backend(cls, vllm_config) -> None:
        cc = vllm_config.cache_config
        if is_kvarn_dtype(cc.cache_dtype):
            from vllm.platforms.interface import PlatformEnum

            from .layout import settle_sliding_layers
            # vLLM 0.32's CPU platform leaves out the page alignment its base
            # platform does (update_block_size_for_backend's phase 3)
            settle_sliding_layers(vllm_config, align=cls._enum == PlatformEnum.CPU)
        super().update_block_size_for_backend(vllm_config)


def _make(name: str, base_path: str):
    mod, cls_name = base_path.rsplit(".", 1)
    base = getattr(importlib.import_module(mod), cls_name)
    return type(name, (_KvarnPlatform, base), {"__module__": __name__,
                                               "__doc__": f"{base.__name__} for kvarn caches"})


def __getattr__(name: str):
    """The platform classes, built on first use (vllm.platforms.cuda does not
    import on vLLM's CPU build)."""
    for base_path, n in _BASES.items():
        if n == name:
            cls = _make(name, base_path)
            globals()[name] = cls
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
