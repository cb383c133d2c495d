"""Every change the plug-in makes to vLLM's own code, in one place.

vLLM 0.32 has public hooks for the rest of what the plug-in does (a platform
plug-in: platform.py; worker and scheduler classes: worker.py,
scheduler.py; register_backend and customize_spec: backend.py). It has none
for a new cache dtype: the names are a closed Literal, their torch dtypes a
table, and the command line's choices come from the Literal. So the dtype
registration alone patches vLLM, and PATCHES lists each patch: its target,
why, and the public hook that would replace it.

check_targets() runs before any patch is applied (plugin.register, in every
process vLLM starts): each target must exist with the shape the patch
expects, or the plug-in refuses to load with a message naming the patch and
the vLLM version it supports, never a bare KeyError or a silent skip.
tests/vllm/test_patches.py checks them against the installed vLLM.
"""
import inspect
import itertools
import typing
from dataclasses import dataclass

from . import SUPPORTED_VLLM


@dataclass(frozen=True)
class Patch:
    name: str
    target: str        # module:attribute
    why: str
    hook: str          # the public hook that would replace it


PATCHES = (
    Patch("dtype_literal", "vllm.config.cache:CacheDType",
          "cache dtypes are a closed Literal, checked by CacheConfig (pydantic) and the "
          "attention selector; the kvarn names are added to it (also to the annotations "
          "of CacheConfig.cache_dtype and EngineArgs.kv_cache_dtype)",
          "none in vLLM 0.32: a registry of cache dtypes beside register_backend"),
    Patch("dtype_torch", "vllm.utils.torch_utils:STR_DTYPE_TO_TORCH_DTYPE",
          "maps a cache dtype to its tensor's torch dtype; kvarn pages are uint8 records",
          "none: the same registry (AttentionBackend could name its cache tensor's dtype)"),
    Patch("cli_choices", "vllm.engine.arg_utils:get_kwargs",
          "--kv-cache-dtype takes its choices from the Literal; it is given a type that "
          "hands any kvarn_* name to the C library, whose error lists what is accepted",
          "none: the same registry"),
    Patch("name_check", "vllm.engine.arg_utils:EngineArgs.create_engine_config",
          "LLM(...) names are checked by pydantic against the Literal, whose error lists "
          "every name; a kvarn_* name is checked first by the library (clear error), and "
          "refused where the kvarn platform is not active (platform.inactive_reason)",
          "none: the same registry, with a validator per dtype"),
)

# What each target must look like: parameter names of a function, or a check.
_SIGNATURES = {
    "get_kwargs": ["cls"],
    "EngineArgs.create_engine_config": ["self", "usage_context", "headless"],
}


def _resolve(target: str):
    import importlib
    mod, attr = target.split(":")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _problem(p: Patch):
    """What is wrong with p's target in the installed vLLM, or None."""
    try:
        obj = _resolve(p.target)
    except (ImportError, AttributeError) as e:
        return f"not found ({e})"
    attr = p.target.split(":")[1]
    if p.name == "dtype_literal":
        if typing.get_origin(obj) is not typing.Literal:
            return f"is {obj!r}, not a typing.Literal"
        from vllm.config.cache import CacheConfig
        from vllm.engine.arg_utils import EngineArgs
        if "cache_dtype" not in getattr(CacheConfig, "__dataclass_fields__", {}):
            return "CacheConfig has no dataclass field cache_dtype"
        if "kv_cache_dtype" not in getattr(EngineArgs, "__dataclass_fields__", {}):
            return "EngineArgs has no dataclass field kv_cache_dtype"
        import vllm.v1.attention.selector as sel
        if getattr(sel, "CacheDType", None) is None:
            return "vllm.v1.attention.selector has no CacheDType"
        return None
    if p.name == "dtype_torch":
        return None if isinstance(obj, dict) else f"is a {type(obj).__name__}, not a dict"
    want = _SIGNATURES[attr]
    fn = getattr(obj, "_kvarn_orig", obj)
    try:
        got = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as e:
        return f"has no signature ({e})"
    if got != want:
        return f"takes ({', '.join(got)}), the patch expects ({', '.join(want)})"
    return None


def check_targets() -> None:
    """RuntimeError naming every patch whose target the installed vLLM lacks
    or has in another shape, and the vLLM version the plug-in supports."""
    import vllm
    bad = [(p, why) for p in PATCHES if (why := _problem(p)) is not None]
    if bad:
        lines = "; ".join(f"patch '{p.name}' ({p.target}) {why}" for p, why in bad)
        raise RuntimeError(
            f"kvarn_vllm cannot register its cache dtypes in vLLM "
            f"{getattr(vllm, '__version__', '?')}: {lines}. The plug-in supports vLLM "
            f"{SUPPORTED_VLLM} (scripts/setup.sh --vllm installs it)")


def kvarn_dtype_names() -> list:
    """Every cache dtype name the plug-in registers: the KVarN presets
    kvarn_k{4,2,8}v{2,4,8}_g{128,64,32}, each also with the suffix c
    (mean-centred values), the per-token formats (_lib.PER_TOKEN_DTYPES:
    kvarn_int8, kvarn_int4, kvarn_fp8_e4m3, kvarn_fp8_e5m2) and the MLA
    record names (_lib.mla_dtype_names)."""
    from ._lib import PER_TOKEN_DTYPES, mla_dtype_names
    return [f"kvarn_k{k}v{v}_g{g}{c}" for c, k, v, g in
            itertools.product(("", "c"), (4, 2, 8), (2, 4, 8), (128, 64, 32))] + \
        list(PER_TOKEN_DTYPES) + mla_dtype_names()


def validate_name(name):
    """argparse type / config check: kvarn_* names go to the C library
    (ValueError with its explanation). Imports no backend
    (kvarn_vllm.ladder checks names with it in a process that forks the
    engines' processes)."""
    from . import _lib
    if _lib.is_mla_dtype(name):
        _lib.mla_parse(name)
    elif _lib.is_kvarn_dtype(name):
        _lib.parse_format(name)
    return name


def _apply_dtype_literal() -> None:
    import vllm.config.cache as cc
    import vllm.engine.arg_utils as au
    import vllm.v1.attention.selector as sel
    names = kvarn_dtype_names()
    old = typing.get_args(cc.CacheDType)
    if names[0] in old:
        return
    new = typing.Literal[tuple(list(old) + names)]  # type: ignore[misc]
    cc.CacheDType = new
    sel.CacheDType = new
    cls = cc.CacheConfig
    cls.__annotations__["cache_dtype"] = new
    cls.__dataclass_fields__["cache_dtype"].type = new
    from pydantic.dataclasses import rebuild_dataclass
    pf = getattr(cls, "__pydantic_fields__", {}).get("cache_dtype")
    if pf is not None:
        pf.annotation = new
    rebuild_dataclass(cls, force=True)
    au.EngineArgs.__annotations__["kv_cache_dtype"] = new
    au.EngineArgs.__dataclass_fields__["kv_cache_dtype"].type = new


def _apply_dtype_torch() -> None:
    import torch
    from vllm.utils import torch_utils
    for n in kvarn_dtype_names():
        torch_utils.STR_DTYPE_TO_TORCH_DTYPE.setdefault(n, torch.uint8)


def _apply_cli_choices() -> None:
    import argparse
    import vllm.engine.arg_utils as au
    if getattr(au.get_kwargs, "_kvarn_orig", None) is not None:
        return
    orig = au.get_kwargs

    def get_kwargs(cls):
        kw = orig(cls)
        from vllm.config.cache import CacheConfig
        if cls is CacheConfig and "cache_dtype" in kw:
            d = dict(kw["cache_dtype"])
            choices = d.pop("choices", None)

            def typ(s, _choices=choices):
                if s.startswith("kvarn_"):
                    try:
                        return validate_name(s)
                    except ValueError as e:
                        raise argparse.ArgumentTypeError(str(e))
                if _choices is not None and s not in _choices:
                    raise argparse.ArgumentTypeError(
                        f"invalid choice {s!r} (choose from {', '.join(map(str, _choices))})")
                return s
            d["type"] = typ
            kw = dict(kw)
            kw["cache_dtype"] = d
        return kw
    get_kwargs._kvarn_orig = orig
    au.get_kwargs = get_kwargs


def _apply_name_check() -> None:
    # LLM(...) builds its EngineArgs before the plug-in is loaded (the load
    # happens in EngineArgs.__post_init__), so the name is checked where the
    # config is made, before pydantic's own (closed-Literal) message.
    import vllm.engine.arg_utils as au
    orig = au.EngineArgs.create_engine_config
    if getattr(orig, "_kvarn_orig", None) is not None:
        return

    def create_engine_config(self, usage_context=None, headless=False):
        from . import _lib
        if _lib.is_kvarn_dtype(self.kv_cache_dtype):
            validate_name(self.kv_cache_dtype)
            from .platform import inactive_reason, is_active
            if not is_active():
                raise ValueError(f"kvarn: --kv-cache-dtype {self.kv_cache_dtype} needs the "
                                 f"kvarn platform plug-in, which is not active: "
                                 f"{inactive_reason()}")
        try:
            return orig(self, usage_context, headless)
        except ValueError as e:
            raise _kvarn_error(e) from None
    create_engine_config._kvarn_orig = orig
    au.EngineArgs.create_engine_config = create_engine_config


def _kvarn_error(e: ValueError) -> ValueError:
    """The kvarn platform's own error where vLLM wrapped it: checks raised in
    the platform's check_and_update_config run inside VllmConfig's pydantic
    validation, which reports them as "1 validation error for VllmConfig";
    e itself for any other error."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        try:
            items = errors()
        except Exception:   # not pydantic's: leave it as it is
            items = []
        for item in items:
            inner = (item.get("ctx") or {}).get("error")
            if isinstance(inner, ValueError) and str(inner).startswith("kvarn"):
                return inner
    return e


_APPLY = {"dtype_literal": _apply_dtype_literal, "dtype_torch": _apply_dtype_torch,
          "cli_choices": _apply_cli_choices, "name_check": _apply_name_check}


def apply() -> None:
    """Check every target, then apply every patch of PATCHES (idempotent)."""
    check_targets()
    for p in PATCHES:
        _APPLY[p.name]()
