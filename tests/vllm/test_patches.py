"""The plug-in's changes to vLLM's own code (kvarn_vllm/patches.py): every
target exists in the installed vLLM with the shape its patch expects; a
target that moved or changed makes the plug-in refuse to load naming the
patch and the supported version; and registering changes nothing in vLLM
that PATCHES does not declare (or the public backend registry)."""
import json
import subprocess
import sys

import pytest

import kvarn_vllm
from kvarn_vllm import patches
from conftest import ROOT


def test_every_target_has_the_expected_shape():
    for p in patches.PATCHES:
        assert patches._problem(p) is None, p.name
    patches.check_targets()


def test_patches_are_declared_with_reason_and_hook():
    names = [p.name for p in patches.PATCHES]
    assert sorted(names) == sorted(patches._APPLY) and len(set(names)) == len(names)
    for p in patches.PATCHES:
        assert ":" in p.target and p.why and p.hook


def test_changed_target_is_refused_naming_patch_and_version(monkeypatch):
    import vllm.engine.arg_utils as au
    monkeypatch.setattr(au, "get_kwargs", lambda cls, extra=None: {})
    with pytest.raises(RuntimeError, match=r"patch 'cli_choices' \(vllm.engine.arg_utils:"
                       r"get_kwargs\) takes \(cls, extra\).*supports vLLM "
                       + kvarn_vllm.SUPPORTED_VLLM.replace(".", r"\.")):
        patches.check_targets()


def test_missing_target_is_refused_naming_patch(monkeypatch):
    from vllm.utils import torch_utils
    monkeypatch.delattr(torch_utils, "STR_DTYPE_TO_TORCH_DTYPE")
    with pytest.raises(RuntimeError, match=r"patch 'dtype_torch' .* not found"):
        patches.check_targets()


# Run in a fresh interpreter: snapshot the attributes of every loaded vLLM
# module and of the classes they define, register the plug-in, and list
# what changed or was added (in modules loaded before).
_SNAPSHOT = r"""
import json, sys, inspect
import vllm.config, vllm.config.cache, vllm.engine.arg_utils, vllm.v1.attention.selector
import vllm.utils.torch_utils, vllm.v1.kv_cache_interface, vllm.v1.core.sched.scheduler
import vllm.v1.worker.cpu_worker, vllm.v1.worker.cpu_model_runner, vllm.platforms.cpu
import vllm.v1.attention.backends.registry

def snap():
    out = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("vllm") or mod is None:
            continue
        for k, v in list(vars(mod).items()):
            out[f"{name}:{k}"] = id(v)
            if inspect.isclass(v) and v.__module__ == name:
                for ck, cv in list(vars(v).items()):
                    out[f"{name}:{k}.{ck}"] = id(cv)
    return out

before = snap()
torch_dtypes = dict(vllm.utils.torch_utils.STR_DTYPE_TO_TORCH_DTYPE)
import kvarn_vllm.plugin
kvarn_vllm.plugin.register()
after = snap()
old_mods = {k.split(":")[0] for k in before}
changed = sorted(k for k in after if k.split(":")[0] in old_mods and before.get(k) != after[k])
added = sorted(k for k in vllm.utils.torch_utils.STR_DTYPE_TO_TORCH_DTYPE if k not in torch_dtypes)
print(json.dumps({"changed": changed, "torch_added": added}))
"""


def test_register_changes_only_what_patches_declares():
    r = subprocess.run([sys.executable, "-c", _SNAPSHOT], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    declared = {p.target.replace(":", ":", 1) for p in patches.PATCHES}
    # the Literal's other homes and the rebuilt pydantic dataclass (dtype_literal)
    allowed_prefixes = ("vllm.v1.attention.selector:CacheDType",
                        "vllm.config.cache:CacheConfig.",
                        "vllm.config:CacheConfig.",
                        # the public backend registry (register_backend)
                        "vllm.v1.attention.backends.registry:")
    undeclared = [k for k in got["changed"]
                  if k not in declared and not k.startswith(allowed_prefixes)]
    assert undeclared == []
    # each declared function patch is in effect
    assert "vllm.engine.arg_utils:get_kwargs" in got["changed"]
    assert "vllm.engine.arg_utils:EngineArgs.create_engine_config" in got["changed"]
    assert "vllm.config.cache:CacheDType" in got["changed"]
    assert set(got["torch_added"]) == set(patches.kvarn_dtype_names())


def test_kvarn_name_refused_where_the_platform_is_not_active(hf_model):
    """VLLM_TARGET_DEVICE=cpu makes vLLM skip its platform plug-ins: a kvarn
    dtype is refused at configuration naming that, not left to fail in the
    engine; vLLM's own dtypes still configure."""
    import os
    code = ("from vllm.engine.arg_utils import EngineArgs\n"
            f"EngineArgs(model={hf_model!r}, block_size=128).create_engine_config()\n"
            "try:\n"
            f"    EngineArgs(model={hf_model!r}, kv_cache_dtype='kvarn_k4v2_g128',"
            " block_size=128).create_engine_config()\n"
            "except ValueError as e:\n"
            "    print('REFUSED', e)\n")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "REFUSED kvarn: --kv-cache-dtype kvarn_k4v2_g128 needs the kvarn platform" in r.stdout
    assert "VLLM_TARGET_DEVICE=cpu" in r.stdout
